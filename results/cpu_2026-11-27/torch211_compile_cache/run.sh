#!/bin/bash
# The first stage of results/gpu_speculative.sh (the exit model, batch 1, K = 2, passes apart and
# 4 chained, --profile) under the GPU machine's torch, 2.11.0+cu130 (the CUDA wheel's CPU kernels;
# venv: results/cpu_2026-11-26/torch211/setup.sh), on the 2-core CPU, twice, each with an empty
# inductor cache as on a machine that starts bare: first with no compile cache file, then with the
# file the first run saved. From the repo root: bash results/cpu_2026-11-27/torch211_compile_cache/run.sh
D=results/cpu_2026-11-27/torch211_compile_cache
P=${PYTHON:-/tmp/venv211/bin/python}
T=$(mktemp -d)
for side in cold cached; do
  start=$(date +%s)
  TORCHINDUCTOR_CACHE_DIR=$T/inductor_$side PYTHONUNBUFFERED=1 timeout -k 5 900 $P bench.py \
    --init_from=out/gpu/spec_exit_w4d2 --draft_layers=2 --speculate=2 --decode_batches=1 \
    --profile=True --decode_prompt=64 --decode_tokens=60 --bench_steps=10 --compile=True \
    --compile_cache=$T/compile_cache.bin --passes_per_graph=1,4 \
    --out=$D/speculative_exit_b1_K2_$side.json > $T/log_$side.txt 2>&1
  rc=$?
  grep -v '^W1\|warn(\|^  ' $T/log_$side.txt > $D/log_$side.txt     # less torch's warnings
  echo "$side: rc=$rc, ${SECONDS}s since the start, $(( $(date +%s) - start )) s wall," \
    "compile cache $(stat -c %s $T/compile_cache.bin) bytes, left beside it:" \
    "$(ls $T | grep -v '^inductor_\|^log_' | tr '\n' ' ')" | tee -a $D/summary.txt
done
rm -rf $T
