# Batch-1 greedy speculative decode of the exit drafter (exit 2, K = 4 and 8) with and without
# --draft_stop=0.25, on four prompts (seeded validation windows), three rounds (each bench run
# times plain decoding beside speculative decoding, so every speedup is same-run), then
# pooled.txt. From the repo root, with out/spec_exit_w4d2 trained as docs/results.md says:
#   bash results/cpu_2026-11-26/draft_stop/run.sh
set -eu
D=results/cpu_2026-11-26/draft_stop
for round in 1 2 3; do
  for stop in 0 0.25; do
    for seed in 1337 1 2 3; do
      python bench.py --init_from=out/spec_exit_w4d2 --draft_layers=2 --speculate=4,8 \
        --decode_batches=1 --decode_prompt=64 --decode_tokens=60 --bench_steps=10 --seed=$seed \
        --draft_stop=$stop --out=$D/exit_w4d2_E2_stop${stop}_seed${seed}_round${round}.json
    done
  done
done
python $D/pooled.py > $D/pooled.txt
