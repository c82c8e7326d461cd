#!/bin/bash
# The 27th session's attention_ab.py at HEAD's kernels (a git worktree of OLD on PYTHONPATH, whose kernel
# build is cached) and at the working tree's, alternating processes: fused / mkl and fused / sdpa are
# in-process ratios, so the two builds compare through their common MKL and SDPA references.
#   bash attention_ab_builds.sh OLD_WORKTREE PAIRS
OLD=$1; PAIRS=${2:-3}
S=docs/results/avx2_2026-11-28_session27/attention_ab.py
for case in "16,256,12,64 1" "16,256,12,64 0.333" "16,256,12,64 0.9" "32,197,6,64 1"; do
  for i in $(seq "$PAIRS"); do
    for build in old new; do
      if [ $build = old ]; then p=$OLD; else p=.; fi
      echo "## $build ($case)"
      PYTHONPATH=$p .venv/bin/python $S $case --rounds 15 2>&1 | grep -E 'fused /'
    done
  done
done
