# Run on the GPU machine: speculative and plain decode, then the GPU suite with the time left.
set -u
export PYTHONUNBUFFERED=1
L=$OUT/log.txt
stage() { local t=$1; shift; echo "=== $(date +%T) t=${SECONDS}s timeout=${t}s: $*" | tee -a $L
  timeout -k 5 $t "$@" 2>&1 | tee -a $L; echo "=== rc=${PIPESTATUS[0]} t=${SECONDS}s" | tee -a $L; }
echo "commit $(cat .gpu/COMMIT)" | tee -a $L
nvidia-smi -L 2>&1 | tee -a $L
python3 -c "import torch,triton,transformers;print('torch',torch.__version__,'cuda',torch.version.cuda,
'triton',triton.__version__,'transformers',transformers.__version__,torch.cuda.get_device_name())" \
  2>&1 | tee -a $L
S="--decode_prompt=64 --decode_tokens=60 --bench_steps=10"
stage 80 python3 bench.py --init_from=.gpu/spec_exit --speculate=1,2,4,8 --decode_batches=1,8 $S \
  --out=$OUT/speculative_exit.json
stage 50 python3 bench.py --init_from=.gpu/spec_mod --speculate=1,2,4,8 --decode_batches=1 $S \
  --out=$OUT/speculative_mod.json
stage 50 python3 bench.py --init_from=.gpu/spec_ffn --speculate=1,2,4,8 --decode_batches=1 $S \
  --out=$OUT/speculative_ffn.json
stage 60 python3 bench.py config/gpt2_124m_fineweb.py --route=exit --compile=False \
  --speculate=1,2,4 --decode_batches=1 --decode_prompt=64 --decode_tokens=60 --bench_steps=5 \
  --out=$OUT/speculative_exit_124m_random.json
stage 60 python3 bench.py config/bench_decode_vs_hf_cpu.py --device=cuda --dtype=bfloat16 \
  --out=$OUT/decode_vs_hf.json
left=$((575 - SECONDS))
stage $left python3 bench.py --suite=gpu --suite_seconds=$((left - 75)) --out_dir=$OUT/suite
