# Run on the GPU machine after run.sh: the trained exit and ffn drafters at batch 1, fewer repeats.
set -u
export PYTHONUNBUFFERED=1
L=$OUT/log2.txt
stage() { local t=$1; shift; echo "=== $(date +%T) t=${SECONDS}s timeout=${t}s: $*" | tee -a $L
  timeout -k 5 $t "$@" 2>&1 | tee -a $L; echo "=== rc=${PIPESTATUS[0]} t=${SECONDS}s" | tee -a $L; }
echo "commit $(cat .gpu/COMMIT)" | tee -a $L
nvidia-smi -L 2>&1 | tee -a $L
S="--decode_batches=1 --decode_prompt=64 --decode_tokens=60"
stage 85 python3 bench.py --init_from=.gpu/spec_exit --speculate=1,2,4,8 $S --bench_steps=5 \
  --out=$OUT/speculative_exit.json
stage 50 python3 bench.py --init_from=.gpu/spec_ffn --speculate=1,2,4 $S --bench_steps=3 \
  --out=$OUT/speculative_ffn.json
