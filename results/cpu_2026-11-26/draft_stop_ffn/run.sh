# Batch-1 greedy speculative decode of ffn's distilled draft (K = 2, 4, 8) with and without
# --draft_stop=0.3, on eight prompts (seeded validation windows), two rounds (each bench run times
# plain decoding beside speculative decoding, so every speedup is same-run), then pooled.txt (by
# the pooling script of the exit runs, results/cpu_2026-11-26/draft_stop/pooled.py).
# From the repo root, with out/ffn_distilled_drafter_shakespeare trained as docs/results.md says
# (these files were written to /tmp and moved here):
#   bash results/cpu_2026-11-26/draft_stop_ffn/run.sh
set -eu
D=results/cpu_2026-11-26/draft_stop_ffn
for round in 1 2; do
  for seed in 1337 1 2 3 4 5 6 7; do
    for stop in 0 0.3; do
      python bench.py --init_from=out/ffn_distilled_drafter_shakespeare --speculate=2,4,8 \
        --decode_batches=1 --decode_prompt=64 --decode_tokens=60 --bench_steps=10 --seed=$seed \
        --draft_stop=$stop --out=$D/ffn_stop${stop}_seed${seed}_round${round}.json > /dev/null 2>&1
    done
  done
done
python results/cpu_2026-11-26/draft_stop/pooled.py $D ffn_stop 0,0.3 2,4,8 > $D/pooled.txt
