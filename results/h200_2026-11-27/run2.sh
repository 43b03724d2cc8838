# On the GPU machine, after run.sh: the same compiled speculative decoding once each pass's draft
# is one CUDA graph and its verification (forward, acceptance, the cache's rollback) another, with
# the kept tokens placed after the last pass. Carry: out/gpu data/shakespeare_char. timeout_s=390.
set -u
export PYTHONUNBUFFERED=1
L=$OUT/log2.txt
END=380
stage() { local t=$1; shift; local left=$((END - SECONDS)); [ $left -lt $t ] && t=$left
  [ $t -lt 20 ] && { echo "=== skipped (no time): $*" | tee -a $L; return; }
  echo "=== $(date +%T) t=${SECONDS}s timeout=${t}s: $*" | tee -a $L
  timeout -k 5 $t "$@" 2>&1 | tee -a $L; echo "=== rc=${PIPESTATUS[0]} t=${SECONDS}s" | tee -a $L; }
echo "commit $(git rev-parse HEAD 2>/dev/null || echo '(no git)')" | tee -a $L
nvidia-smi -L 2>&1 | tee -a $L
S="--decode_prompt=64 --decode_tokens=60 --bench_steps=5 --compile=True"
stage 140 python3 bench.py --init_from=out/gpu/spec_exit_w4d2 --draft_layers=2 --speculate=2,4 \
  --decode_batches=1,8 $S --out=$OUT/speculative_exit_w4d2_E2_compiled_fused.json
stage 75 python3 bench.py --init_from=out/gpu/spec_mod --speculate=4,8 --decode_batches=1 $S \
  --out=$OUT/speculative_mod_compiled_fused.json
stage 100 python3 bench.py config/gpt2_124m_fineweb.py --route=exit --speculate=2,4 \
  --decode_batches=1 $S --out=$OUT/speculative_exit_124m_random_compiled_fused.json
stage 90 python3 bench.py --init_from=out/gpu/ffn_distilled_drafter_shakespeare --speculate=2,4 \
  --decode_batches=1 $S --out=$OUT/speculative_ffn_distilled_compiled_fused.json
