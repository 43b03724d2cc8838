#!/bin/bash
# The suite, then the GPU run's commands on the CPU at tiny lengths (one repeat: the numbers mean
# nothing, only that each command runs under torch 2.11). The checkpoints are the 8-layer
# Shakespeare drafters of docs/results.md, without their optimizer state (out/gpu/).
D=results/cpu_2026-11-26/torch211
P=/tmp/venv211/bin/python
CI=true $P -m pytest -q -p no:cacheprovider -rs > $D/pytest_torch211.log 2>&1
S="--decode_prompt=64 --decode_tokens=20 --bench_steps=1 --compile=True"
{
$P bench.py --init_from=out/gpu/spec_exit_w4d2 --draft_layers=2 --speculate=2 --decode_batches=1 $S
$P bench.py --init_from=out/gpu/ffn_distilled_drafter_shakespeare --speculate=2 \
  --decode_batches=1 $S
$P bench.py --init_from=out/gpu/spec_mod --speculate=4 --decode_batches=1 $S
$P bench.py --init_from=out/gpu/spec_halt --speculate=2 --decode_batches=1 $S
$P bench.py config/gpt2_124m_fineweb.py --route=exit --speculate=2 --decode_batches=1 \
  --decode_prompt=64 --decode_tokens=8 --bench_steps=1
$P bench.py config/bench_decode_vs_hf_cpu.py --decode_tokens=8 --bench_steps=1 --decode_batches=1
$P bench.py --suite=gpu --smoke=True --compile=True --out_dir=/tmp/suite_torch211
} > $D/gpu_commands_torch211.log 2>&1
