#!/bin/bash
# The ffn drafter's speculative decoding on the 2-core CPU, run from the repository root, one
# command at a time with nothing else running. The model: python train.py
# config/ffn_drafter_shakespeare.py (trained as the equivalent command line in models/ffn_drafter,
# its out_dir then copied to out/ffn_drafter_shakespeare). mimic01/ holds the ffn runs below again
# for the same config with --ffn_mimic_weight=0.1 (models/ffn_drafter_mimic01, its out_dir copied
# to out/ffn_drafter_shakespeare for them; their JSON names the paths of this folder, where they
# were written, then moved). models/ffn_drafter_noclip: the config with --grad_clip=0.0 (trained
# only). Both trainings ran side by side with OMP_NUM_THREADS=1.
set -e
D=results/cpu_2026-11-26/ffn_drafter
M=out/ffn_drafter_shakespeare
B="python bench.py --decode_prompt=64 --decode_tokens=60"
# greedy, the table's prompt (seed 1337), batch 1 and 8
$B --init_from=$M --speculate=1,2,3,4 --decode_batches=1,8 --bench_steps=15 --out=$D/speculative_ffn_drafter.json | tee $D/speculative_ffn_drafter.log
# greedy, seven more prompts, batch 1
for s in 1 2 3 4 5 6 7; do
  $B --init_from=$M --speculate=1,2,3,4 --decode_batches=1 --bench_steps=10 --seed=$s --out=$D/prompts/speculative_ffn_drafter_seed$s.json | tee $D/prompts/speculative_ffn_drafter_seed$s.log
done
# sampled at temperature 1, the table's prompt and three more, batch 1
for s in 1337 1 2 3; do
  $B --init_from=$M --speculate=1,2,3,4 --decode_batches=1 --bench_steps=15 --seed=$s --temperature=1.0 --out=$D/sampled/speculative_ffn_drafter_T1_seed$s.json | tee $D/sampled/speculative_ffn_drafter_T1_seed$s.log
done
# the rank-16 imitating model of ffn_mimic/ at this commit, for comparison
$B --init_from=out/spec_ffn_mimic2 --speculate=1,2,3,4 --decode_batches=1 --bench_steps=15 --out=$D/speculative_ffn_mimic2_rank16.json | tee $D/speculative_ffn_mimic2_rank16.log
$B --init_from=out/spec_ffn_mimic2 --speculate=1,2,3,4 --decode_batches=1 --bench_steps=15 --temperature=1.0 --out=$D/sampled/speculative_ffn_mimic2_rank16_T1.json | tee $D/sampled/speculative_ffn_mimic2_rank16_T1.log
# the other families' drafts sampled at temperature 1 (their greedy rows: docs/results.md)
for s in 1337 1 2 3; do
  $B --init_from=out/spec_exit_w4d2 --speculate=2,4 --draft_layers=2 --decode_batches=1 --bench_steps=15 --seed=$s --temperature=1.0 --out=$D/sampled/speculative_exit_w4d2_E2_T1_seed$s.json | tee $D/sampled/speculative_exit_w4d2_E2_T1_seed$s.log
done
for f in mod halt; do
  $B --init_from=out/spec_$f --speculate=2,4 --decode_batches=1 --bench_steps=15 --temperature=1.0 --out=$D/sampled/speculative_${f}_T1.json | tee $D/sampled/speculative_${f}_T1.log
done
