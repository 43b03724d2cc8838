# Four calls to the device tool, one after another on the same H200 (17:04-17:17 UTC), each with
# carry ["out/gpu", "data/shakespeare_char"] (the checkpoints of results/cpu_2026-11-28/
# gpu_checkpoints/, trained on the CPU), at commit ca00710 with a clean tree.

# 1 (limit 510 s; output: log.txt, nvidia_smi.txt, the ffn, halt and exit_b8 JSONs)
mkdir -p $OUT/r && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv \
  > $OUT/r/nvidia_smi.txt 2>&1
COMPILE_CACHE=/tmp/cc.bin bash results/gpu_speculative.sh $OUT/r 470; cp /tmp/cc.bin $OUT/

# 2 (limit 200 s; output: log_one_graph.txt): the stage the first call's time limit stopped,
# alone, without the compile cache
timeout -k 5 170 python3 bench.py --init_from=out/gpu/spec_exit_w4d2 --draft_layers=2 \
  --speculate=4 --decode_batches=1 --one_graph=True --decode_prompt=64 --decode_tokens=60 \
  --bench_steps=10 --compile=True --passes_per_graph=1,4 \
  --out=$OUT/r2/speculative_exit_b1_K4_one_graph.json > $OUT/r2/log_one_graph.txt 2>&1

# 3 (limit 250 s; output: log_one_graph_cached.txt, log_mod.txt): the same with the first call's
# compile cache, then mod (passes apart only, to fit)
TORCHDYNAMO_VERBOSE=1 timeout -k 5 110 python3 bench.py --init_from=out/gpu/spec_exit_w4d2 \
  --draft_layers=2 --speculate=4 --decode_batches=1 --one_graph=True --decode_prompt=64 \
  --decode_tokens=60 --bench_steps=10 --compile=True --compile_cache=/tmp/cc.bin \
  --passes_per_graph=1,4 --out=$OUT/r3/speculative_exit_b1_K4_one_graph_cached.json \
  > $OUT/r3/log_one_graph_cached.txt 2>&1
timeout -k 5 130 python3 bench.py --init_from=out/gpu/spec_mod --speculate=4 --decode_batches=1 \
  --decode_prompt=64 --decode_tokens=60 --bench_steps=10 --compile=True --passes_per_graph=1 \
  --out=$OUT/r3/speculative_mod_b1_K4.json > $OUT/r3/log_mod.txt 2>&1

# 4 (limit 155 s; output: log_halt.txt): halt again with 30 repeats a side (its first run's
# plain side spread by 99%)
timeout -k 5 140 python3 bench.py --init_from=out/gpu/spec_halt --speculate=4 --decode_batches=1 \
  --decode_prompt=64 --decode_tokens=60 --bench_steps=30 --compile=True \
  --compile_cache=/tmp/cc.bin --passes_per_graph=1,4 \
  --out=$OUT/r4/speculative_halt_b1_K4_steps30.json > $OUT/r4/log_halt.txt 2>&1
