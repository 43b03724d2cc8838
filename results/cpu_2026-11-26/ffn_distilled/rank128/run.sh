#!/bin/bash
# The distilled draft at rank 128 rather than 64 (at 8bbabd5), run from the repository
# root, one command at a time with nothing else running:
#   python train.py config/ffn_distilled_drafter_shakespeare.py --init_from=out/spec_ffn/ckpt.pt \
#       --ffn_draft_rank=128 --out_dir=out/ffn_distilled_r128
# (train.log here); then the batch-1 runs of ../run.sh for this model.
set -e
D=results/cpu_2026-11-26/ffn_distilled/rank128
M=out/ffn_distilled_r128
B="python bench.py --decode_prompt=64 --decode_tokens=60"
for s in 1337 1 2 3 4 5 6 7; do
  $B --init_from=$M --speculate=1,2,3,4 --decode_batches=1 --bench_steps=10 --seed=$s --out=$D/prompts/speculative_ffn_distilled_r128_seed$s.json | tee $D/prompts/speculative_ffn_distilled_r128_seed$s.log
done
for s in 1337 1 2 3; do
  $B --init_from=$M --speculate=1,2,3,4 --decode_batches=1 --bench_steps=15 --seed=$s --temperature=1.0 --out=$D/sampled/speculative_ffn_distilled_T1_seed$s.json | tee $D/sampled/speculative_ffn_distilled_T1_seed$s.log
done
