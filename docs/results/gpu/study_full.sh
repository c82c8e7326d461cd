#!/usr/bin/env bash
# Continue the full study on a lent GPU machine (docs/results/study_full_gpu; resumable: finished runs are skipped).
#   bash docs/results/gpu/study_full.sh prepare                 # here first: the data and the extractor into .gpu
#   LIMIT=400 OUT=$OUT bash docs/results/gpu/study_full.sh run   # on the GPU machine (device tool, carry [".gpu"])
#   bash docs/results/gpu/study_full.sh collect DIR              # here after: DIR = the call's files_at
# prepare: the Fashion-MNIST files (the Debian package's) in .gpu/fashion-mnist and the fashion_mnist extractor trained
# here on the CPU in .gpu/cache (so the GPU runs are scored with the CPU study's features), beside .gpu/site (run.sh).
# run: the study resumed for LIMIT seconds (7 runs at a time), its folder packed into $OUT without checkpoints; a run
# cut by the limit starts again next time. collect: the completed runs into the repository, and the report over them.
set -eu
STUDY=docs/results/study_full_gpu
case ${1:?prepare, run or collect} in
  prepare)
    mkdir -p .gpu/fashion-mnist .gpu/cache
    cp /usr/share/datasets/fashion-mnist/*-ubyte.gz .gpu/fashion-mnist/
    VISATTN_CACHE=$PWD/.gpu/cache .venv/bin/python -c "from visattn.metrics.domain import load_domain_extractor as f
f('fashion_mnist', root='.gpu/fashion-mnist')"
    du -sh .gpu
    ;;
  run)
    OUT=${OUT:?set OUT}
    export PYTHONPATH=$PWD:$PWD/.gpu/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 VISATTN_CACHE=$PWD/.gpu/cache
    PY=${PY:-python3}
    # the study's configs read the Debian package's folder (data.root: null)
    mkdir -p /usr/share/datasets/fashion-mnist && cp -n .gpu/fashion-mnist/* /usr/share/datasets/fashion-mnist/
    # in place (this machine's copy of the tree is thrown away), so the runs' configs name the repository's paths
    timeout "${LIMIT:-400}" $PY -m visattn.study --profile full --out $STUDY --jobs 7 \
      >"$OUT/study.log" 2>&1 || echo "study: rc=$? (124: the limit)" >>"$OUT/study.log"
    tar -czf "$OUT/study_full_gpu.tar.gz" --exclude=checkpoints --exclude="*.safetensors" --exclude="*.pt" \
      --exclude=tb -C "$(dirname $STUDY)" study_full_gpu
    tail -5 "$OUT/study.log"
    ;;
  collect)
    DIR=${2:?the folder the call returned (files_at)}
    TMP=$(mktemp -d)
    tar -xzf "$DIR/study_full_gpu.tar.gz" -C "$TMP"
    # the completed runs only (a run cut by the limit has no results.json or one saying completed: false); then the
    # report and its plots over them, here (README.md is written by hand)
    .venv/bin/python - "$TMP/study_full_gpu" "$STUDY" <<'PYEOF'
import shutil, sys
from pathlib import Path
from visattn.study.runner import run_completed
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
for results in sorted(src.glob("runs/*/*/*/results.json")):
    run = results.parent
    if run_completed(run) and not run_completed(dst / run.relative_to(src)):
        shutil.copytree(run, dst / run.relative_to(src), dirs_exist_ok=True)
        print("collected", run.relative_to(src))
PYEOF
    rm -rf "$TMP"
    .venv/bin/python -m visattn.study --profile full --out $STUDY --report-only
    ;;
  *) echo "usage: $0 prepare|run|collect" >&2; exit 2 ;;
esac
