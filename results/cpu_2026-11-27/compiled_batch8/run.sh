#!/bin/bash
# The exit model (E = 2) at batch 8, both sides compiled, passes apart beside 4 chained in one
# process, K = 2 and 4. From the repo root; the log's first line has the command.
set -e
dir=results/cpu_2026-11-27/compiled_batch8
cmd="python bench.py --init_from=out/gpu/spec_exit_w4d2 --draft_layers=2 --speculate=2,4
 --passes_per_graph=1,4 --decode_batches=8 --decode_prompt=64 --decode_tokens=60 --bench_steps=10
 --compile=True --compile_cache=out/cpu_compile_exit.bin --out=$dir/exit_E2_b8_apart_chained.json"
echo $cmd > $dir/exit_E2_b8_apart_chained.log
$cmd 2>&1 | tee -a $dir/exit_E2_b8_apart_chained.log
