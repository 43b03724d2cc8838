# On the 2-core CPU machine: the same bench twice, each with an empty inductor cache folder (as a
# GPU machine starts), the second reading the compiled code the first kept in --compile_cache.
# Ran with the paths of a scratch folder (/work/scratch/cc) in place of these.
for i in 1 2; do
  rm -rf /tmp/icc$i; export TORCHINDUCTOR_CACHE_DIR=/tmp/icc$i
  s=$(date +%s)
  nice python bench.py --init_from=out/gpu/spec_exit_w4d2 --draft_layers=2 --speculate=2 \
   --decode_batches=1 --passes_per_graph=1,4 --decode_prompt=64 --decode_tokens=60 \
   --bench_steps=3 --compile=True --compile_cache=out/compile_cache/cache.bin \
   --out=results/cpu_2026-11-27/compile_cache/run$i.json > run$i.txt 2>&1
  echo "run $i rc=$? $(( $(date +%s) - s )) s" >> times.txt
done
