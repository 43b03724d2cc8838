# Cold warm-up of 4 chained passes, unrolled (commit 44368e2) and with the pass compiled once
# (08bc94d), under torch 2.13 (python) and the GPU machine's 2.11 (the venv of
# results/cpu_2026-11-26/torch211/setup.sh), on the 2-core CPU: the trained exit model (E = 2),
# batch 1, K = 4, 60 greedy tokens, 3 repeats a side, each run with an empty inductor cache.
# From the repo root, with out/gpu (bash results/gpu_checkpoints.sh) and data/shakespeare_char:
#   bash results/cpu_2026-11-27/chained_compile_once/run.sh
set -eu
here=results/cpu_2026-11-27/chained_compile_once
for commit in 44368e2 08bc94d; do
  tree=/tmp/chained_$commit
  rm -rf $tree; git worktree add -q --detach $tree $commit
  ln -s "$PWD/out" $tree/out; ln -s "$PWD/data/shakespeare_char" $tree/data/shakespeare_char
  for py in python /tmp/venv211/bin/python; do
    v=$($py -c "import torch; print(torch.__version__.split('+')[0])")
    export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_${commit}_$v; rm -rf $TORCHINDUCTOR_CACHE_DIR
    (cd $tree && $py bench.py --init_from=out/gpu/spec_exit_w4d2 --draft_layers=2 --speculate=4 \
      --decode_batches=1 --decode_prompt=64 --decode_tokens=60 --bench_steps=3 --compile=True \
      --passes_per_graph=4 --out="$OLDPWD/$here/exit_K4_chained_${commit}_torch$v.json") \
      > $here/log_${commit}_torch$v.txt 2>&1
    echo "$commit torch $v: $(grep '^| 1' $here/log_${commit}_torch$v.txt)" | tee -a $here/summary.txt
  done
  git worktree remove --force $tree
done
