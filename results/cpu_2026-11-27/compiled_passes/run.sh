#!/bin/bash
# Compiled self-speculative decoding on the 2-core CPU against compiled plain decoding, on the
# trained 8-layer models of docs/results.md (the copies in out/gpu/ that the H200 runs used), each
# pass as two graphs (draft, verification), as one (--one_graph=True), and chained P passes to a
# graph (--passes_per_graph=P). From the repo root; each log's first line has the command.
set -e
dir=results/cpu_2026-11-27/compiled_passes
common="--decode_batches=1 --decode_prompt=64 --decode_tokens=60 --bench_steps=10 --compile=True"
run() {     # name, then bench.py's options
  name=$1; shift
  echo "python bench.py $* $common --out=$dir/$name.json" > $dir/$name.log
  python bench.py "$@" $common --out=$dir/$name.json 2>&1 | tee -a $dir/$name.log
}
exit_model="--init_from=out/gpu/spec_exit_w4d2 --draft_layers=2 --speculate=2,4"
mod_model="--init_from=out/gpu/spec_mod --speculate=4,8"
run speculative_exit_E2_two_graphs $exit_model
run speculative_exit_E2_one_graph $exit_model --one_graph=True
run speculative_exit_E2_chained2 $exit_model --passes_per_graph=2
run speculative_exit_E2_chained4 $exit_model --passes_per_graph=4
run speculative_mod_two_graphs $mod_model
run speculative_mod_one_graph $mod_model --one_graph=True
run speculative_mod_chained4 $mod_model --passes_per_graph=4
