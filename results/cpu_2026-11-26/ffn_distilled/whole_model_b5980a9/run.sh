#!/bin/bash
# The first recipe of ffn's distilled draft: L_draft on the all-draft model, whose every position
# read the draft's own K/V, where decoding's draft reads the model's. To rerun it, check out
# b5980a9 (where the recipe and this script were), train the draft as below, and run this script
# there; afterwards its checkpoint was moved to out/ffn_distilled_all_draft and this folder to
# whole_model_b5980a9/ (../pooled.py whole_model_b5980a9 and ../draft_quality.py
# out/ffn_distilled_all_draft read them there); ../ holds the draft that learned in the model's
# context.
# ffn's distilled draft on the 2-core CPU, run from the repository root, one command at a time with
# nothing else running. The model under it is out/spec_ffn (docs/results.md: trained as
#   python train.py config/exit_drafter_shakespeare.py --route=ffn --ffn_gate=mlp --ffn_budget=0.5 \
#       --ffn_layers=all --layer_dropout=0.0 --out_dir=out/spec_ffn
# at f2650ca); its draft (train.log, metrics.jsonl, config.json, run_info.json here):
#   python train.py config/ffn_distilled_drafter_shakespeare.py --init_from=out/spec_ffn/ckpt.pt
# The cheap-path drafter beside it: out/ffn_drafter_shakespeare (config/ffn_drafter_shakespeare.py,
# results/cpu_2026-11-26/ffn_drafter/).
set -e
D=results/cpu_2026-11-26/ffn_distilled    # (at b5980a9; now whole_model_b5980a9/)
M=out/ffn_distilled_drafter_shakespeare
B="python bench.py --decode_prompt=64 --decode_tokens=60"
mkdir -p $D/prompts $D/sampled
# greedy, the table's prompt (seed 1337), batch 1 and 8
$B --init_from=$M --speculate=1,2,3,4 --decode_batches=1,8 --bench_steps=15 --out=$D/speculative_ffn_distilled.json | tee $D/speculative_ffn_distilled.log
# greedy, seven more prompts, batch 1
for s in 1 2 3 4 5 6 7; do
  $B --init_from=$M --speculate=1,2,3,4 --decode_batches=1 --bench_steps=10 --seed=$s --out=$D/prompts/speculative_ffn_distilled_seed$s.json | tee $D/prompts/speculative_ffn_distilled_seed$s.log
done
# sampled at temperature 1, the table's prompt and three more, batch 1: the distilled draft, and
# the cheap-path drafter's model at this commit
for s in 1337 1 2 3; do
  $B --init_from=$M --speculate=1,2,3,4 --decode_batches=1 --bench_steps=15 --seed=$s --temperature=1.0 --out=$D/sampled/speculative_ffn_distilled_T1_seed$s.json | tee $D/sampled/speculative_ffn_distilled_T1_seed$s.log
  $B --init_from=out/ffn_drafter_shakespeare --speculate=1,2,3,4 --decode_batches=1 --bench_steps=15 --seed=$s --temperature=1.0 --out=$D/sampled/speculative_ffn_drafter_T1_seed$s.json | tee $D/sampled/speculative_ffn_drafter_T1_seed$s.log
done
# the greedy continuations timed above, as text
python results/cpu_2026-11-26/ffn_drafter/greedy_texts.py $M > $D/greedy_texts.txt
