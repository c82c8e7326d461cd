#!/usr/bin/env bash
# Issue 32 on a lent GPU machine (repository root), about 10 minutes: MoH with the Triton routing kernel
# (visattn/kernels/cuda_routing.py) against MHA and against the PyTorch routing, in one call, the steps that
# matter most first.
#   OUT=DIR bash docs/results/gpu/moh.sh
#   ONLY="launches paths" OUT=DIR bash docs/results/gpu/moh.sh   # some steps alone
# Packages the GPU image lacks travel in .gpu/site as for run.sh. Every log and JSON lands in $OUT/moh (packed
# as $OUT/moh.tar.gz after each step), the step summary in $OUT/summary.txt.
set -u
OUT=${OUT:?set OUT to a folder for the results}
R=$OUT/moh
mkdir -p "$R"
export PYTHONPATH=$PWD:$PWD/.gpu/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PY:-python3}
SUMMARY=$OUT/summary.txt

source "$(dirname "$0")/steps.sh"

device_info

# 1. The kernel against the PyTorch routing on the GPU (and a bf16 ViT-S through it).
step tests 80 $PY -m pytest -q -p no:cacheprovider tests/test_cuda_routing.py
# 2. Whole models: ViT-S and DiT-B/2 (batch 64), the study's models (batch 256); '<attn> pytorch' rows: kernels off.
step models 100 $PY -m visattn.bench model --device cuda --presets vit_small dit_b2 --attns mha moh-50 moh-75 moh-90 \
  --batch 64 --dtypes bf16 --repeats 10 --no-memory --compare-kernels --out "$R/models.json"
step study 80 $PY -m visattn.bench study --device cuda --cells mha moh-50 moh-75 moh-90 --batch 256 --dtypes bf16 \
  --repeats 10 --compare-kernels --out "$R/study.json"
# 3. One layer: launches and eager time; then replayed from CUDA graphs (the GPU's own time), MoH vs MHA.
step launches 100 $PY docs/results/gpu/moh_launches.py --out "$R/launches.json"
step graphs 60 $PY docs/results/gpu/moh_launches.py --mode graph --out "$R/graphs.json"
# 4. The paths bench (every exact path, auto's choice): bf16 and fp32 at the issue's shapes; bf16 at 8x their batch.
step paths 180 $PY -m visattn.bench paths --device cuda --shapes 32,197,384,6 16,256,768,12 256,17,96,8 256,49,64,8 \
  --budgets 0.5 0.75 0.9 --dtypes bf16 fp32 --repeats 10 --out "$R/paths.json"
step paths_large 90 $PY -m visattn.bench paths --device cuda --shapes 256,197,384,6 128,256,768,12 \
  --budgets 0.5 0.75 0.9 --dtypes bf16 --repeats 5 --out "$R/paths_large.json"
# 5. The paths bench with the PyTorch routing (kernels off), bf16, for the before/after of the masked dense row.
step paths_pytorch 40 env VISATTN_KERNELS=0 $PY -m visattn.bench paths --device cuda --shapes 32,197,384,6 16,256,768,12 \
  256,17,96,8 256,49,64,8 --budgets 0.5 0.75 0.9 --dtypes bf16 --repeats 10 --out "$R/paths_pytorch.json"
