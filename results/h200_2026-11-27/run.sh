# On the GPU machine: compiled (CUDA-graph) speculative decoding of the trained 8-layer drafters,
# then the GPT-2 124M shape with exits (random weights: real costs, meaningless acceptance).
# Carry: out/gpu data/shakespeare_char, made on the CPU machine by copying each checkpoint of
# out/<name> without its optimizer state to out/gpu/<name>. One call, timeout_s=590.
set -u
export PYTHONUNBUFFERED=1
L=$OUT/log.txt
stage() { local t=$1; shift; echo "=== $(date +%T) t=${SECONDS}s timeout=${t}s: $*" | tee -a $L
  timeout -k 5 $t "$@" 2>&1 | tee -a $L; echo "=== rc=${PIPESTATUS[0]} t=${SECONDS}s" | tee -a $L; }
echo "checkpoints made at commit $(cat out/gpu/COMMIT)" | tee -a $L
nvidia-smi -L 2>&1 | tee -a $L
python3 -c "import torch,triton;print('torch',torch.__version__,'cuda',torch.version.cuda,
'triton',triton.__version__,torch.cuda.get_device_name())" 2>&1 | tee -a $L
S="--decode_prompt=64 --decode_tokens=60 --bench_steps=5 --compile=True"
stage 200 python3 bench.py --init_from=out/gpu/spec_exit_w4d2 --draft_layers=2 --speculate=2,4 \
  --decode_batches=1,8 $S --out=$OUT/speculative_exit_w4d2_E2_compiled.json
stage 120 python3 bench.py --init_from=out/gpu/ffn_distilled_drafter_shakespeare --speculate=2,4 \
  --decode_batches=1 $S --out=$OUT/speculative_ffn_distilled_compiled.json
stage 100 python3 bench.py --init_from=out/gpu/spec_mod --speculate=4,8 --decode_batches=1 $S \
  --out=$OUT/speculative_mod_compiled.json
stage 100 python3 bench.py --init_from=out/gpu/spec_halt --speculate=2,4 --decode_batches=1 $S \
  --out=$OUT/speculative_halt_compiled.json
left=$((578 - SECONDS))
stage $left python3 bench.py config/gpt2_124m_fineweb.py --route=exit --speculate=2,4 \
  --decode_batches=1 $S --out=$OUT/speculative_exit_124m_random_compiled.json
