# The second call, on the same warm H200 right after `bash results/gpu_speculative.sh`
# (whose stages exit_b1_K4 and mod_b1_K4 had been stopped while compiling): those two stages and
# ffn's again, without --profile, in 270 s. Output (warnings filtered out): log2.txt.
mkdir -p $OUT/r; C=/tmp/cc.bin; ls -la $C; S=$SECONDS
for s in "exit_b1_K4 --init_from=out/gpu/spec_exit_w4d2 --draft_layers=2 --speculate=4" \
    "mod_b1_K4 --init_from=out/gpu/spec_mod --speculate=4" \
    "ffn_b1_K4 --init_from=out/gpu/ffn_distilled_drafter_shakespeare --speculate=4"; do
  set -- $s; n=$1; shift; left=$((270-SECONDS+S)); [ $left -lt 30 ] && break
  echo "=== $n t=$((SECONDS-S)) limit $left"
  timeout -k 5 $left python3 bench.py "$@" --decode_batches=1 --decode_prompt=64 \
    --decode_tokens=60 --bench_steps=10 --compile=True --compile_cache=$C \
    --passes_per_graph=1,4 --out=$OUT/r/speculative_$n.json 2>&1 | grep -v Warn
  echo "=== $n rc=${PIPESTATUS[0]} t=$((SECONDS-S))"
done
ls -la $OUT/r
