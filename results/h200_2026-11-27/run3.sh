# On the GPU machine, code of commit 116ec1d: compiled speculative decoding once a pass returns
# only what decoding reads, the plain step returns its logits alone, and P whole passes chain in
# one function (--passes_per_graph). P = 1 without --one_graph: draft and verification graphs
# apart; P = 4: four passes a graph and a host round trip. Carry: out/gpu data/shakespeare_char.
# timeout_s=560.
set -u
export PYTHONUNBUFFERED=1
L=$OUT/log3.txt
END=545
stage() { local t=$1; shift; local left=$((END - SECONDS)); [ $left -lt $t ] && t=$left
  [ $t -lt 30 ] && { echo "=== skipped (no time): $*" | tee -a $L; return; }
  echo "=== $(date +%T) t=${SECONDS}s timeout=${t}s: $*" | tee -a $L
  timeout -k 5 $t "$@" 2>&1 | tee -a $L; echo "=== rc=${PIPESTATUS[0]} t=${SECONDS}s" | tee -a $L; }
nvidia-smi -L 2>&1 | tee -a $L
python3 -c "import torch,triton;print('torch',torch.__version__,'cuda',torch.version.cuda,
'triton',triton.__version__,torch.cuda.get_device_name())" 2>&1 | tee -a $L
S="--decode_prompt=64 --decode_tokens=60 --bench_steps=5 --compile=True --profile=True"
stage 190 python3 bench.py --init_from=out/gpu/spec_exit_w4d2 --draft_layers=2 --speculate=2,4 \
  --decode_batches=1,8 --passes_per_graph=1,4 $S \
  --out=$OUT/speculative_exit_w4d2_E2_compiled_chained.json
stage 100 python3 bench.py --init_from=out/gpu/spec_mod --speculate=4,8 --decode_batches=1 \
  --passes_per_graph=1,4 $S --out=$OUT/speculative_mod_compiled_chained.json
stage 100 python3 bench.py --init_from=out/gpu/ffn_distilled_drafter_shakespeare --speculate=2,4 \
  --decode_batches=1 --passes_per_graph=1,4 $S \
  --out=$OUT/speculative_ffn_distilled_compiled_chained.json
stage 100 python3 bench.py --init_from=out/gpu/spec_exit_w4d2 --draft_layers=2 --speculate=2,4 \
  --decode_batches=1 --one_graph=True --passes_per_graph=1,2 $S \
  --out=$OUT/speculative_exit_w4d2_E2_compiled_one_graph.json
stage 100 python3 bench.py --init_from=out/gpu/spec_halt --speculate=2,4 --decode_batches=1 \
  --passes_per_graph=1,4 $S --out=$OUT/speculative_halt_compiled_chained.json
