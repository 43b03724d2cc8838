# Compiled self-speculative decoding of the trained 8-layer models on one GPU, in one command:
#
#   bash results/gpu_speculative.sh FOLDER [SECONDS]
#
# Each stage is one bench.py process (greedy, 60 tokens from 64-token prompts, 10 repeats a side,
# both sides compiled), passes apart and 4 chained in one graph (--passes_per_graph=1,4) timed in
# the same process, writing FOLDER/speculative_<stage>.json (.partial.json if stopped first) and
# its output to FOLDER/log.txt. The stages run in order of what they tell (what no GPU has
# measured first), each stopped at its own limit or at what is left of SECONDS (540), so a cold
# compile that runs long costs the last stages, not the first. Compiled code is kept in
# $COMPILE_CACHE (out/compile_cache_gpu.bin), also by a stage that is stopped: a machine that
# starts bare then compiles only what no run kept. Time
# left after the last stage goes to the stages stopped at their limit, in order, again: each then
# starts from the code it compiled before its stop.
# On a lent GPU, whose lease returns at most 8 files (this writes 10 or more): PACK=$OUT/r.tgz
# bash results/gpu_speculative.sh /tmp/r 540 (the folder packed into one archive at the end).
# Needs data/shakespeare_char (the prompts; python data/prepare.py shakespeare_char makes it, 1 MB:
# carry it) and the checkpoints out/gpu/<name>, optimizer-free copies of the runs in
# docs/results.md. Where torch sees a GPU, the missing ones are first trained there by
# results/gpu_checkpoints.sh (all six at once, at most TRAIN_SECONDS, 300, of SECONDS; their log in
# FOLDER/train_log.txt); elsewhere carry out/gpu (the same script makes it on the CPU in 60-75
# minutes). Stops before any work if the data, or a checkpoint it cannot train, is missing.
set -u
folder=${1:?usage: bash results/gpu_speculative.sh FOLDER [SECONDS]}
source "$(dirname "$0")/speculative_stages.sh"
checkpoints=(out/gpu/{spec_exit_w4d2,spec_mod,spec_halt,ffn_distilled_drafter_shakespeare}/ckpt.pt
             out/gpu/{spec_ensemble,spec_dense}/ckpt.pt)
carry="carry out/gpu and data/shakespeare_char"
require_files "make it with python data/prepare.py shakespeare_char and $carry" \
  data/shakespeare_char/{train.bin,val.bin,meta.json}
if ! torch_sees_gpu; then
  require_files "make them with bash results/gpu_checkpoints.sh (on the CPU, 60-75 minutes) and \
$carry, or run this where torch sees a GPU, which trains them first" "${checkpoints[@]}"
fi
end=${2:-540}
cache=${COMPILE_CACHE:-out/compile_cache_gpu.bin}
start_log
if [ -n "$(missing_files "${checkpoints[@]}")" ]; then
  limit=${TRAIN_SECONDS:-300}
  echo "=== $(date +%T) t=${SECONDS}s training the missing checkpoints, limit ${limit} s" \
    | tee -a "$log"
  timeout -k 10 $limit bash "$(dirname "$0")/gpu_checkpoints.sh" "$folder/train_log.txt"
  echo "=== training: rc=$? t=${SECONDS}s" | tee -a "$log"
  tail -n 8 "$folder/train_log.txt" | tee -a "$log"
fi
exit_model="--init_from=out/gpu/spec_exit_w4d2 --draft_layers=2"
# first what no GPU has measured (mod chained on these checkpoints; exit at K = 2 with the GPU's
# busy time; the ensemble's earliest layer and the dense model's first 4 blocks as drafts), then
# the stages measured on 2026-11-27 and 2026-11-28 (results/h200_2026-11-2*/gpu_speculative/)
# again; a cold stage took 74-170 s there (4 chained: 31-102 s of warm-up), so
# a limit below 170 s may stop it unfinished
stage mod_b1_K4 170 --init_from=out/gpu/spec_mod --speculate=4 --decode_batches=1
stage exit_b1_K2 180 $exit_model --speculate=2 --decode_batches=1 --profile=True
stage ensemble_b1_K4 170 --init_from=out/gpu/spec_ensemble --speculate=4 --decode_batches=1
stage dense_b1_K4 170 --init_from=out/gpu/spec_dense --speculate=4 --decode_batches=1
stage ffn_b1_K4 170 --init_from=out/gpu/ffn_distilled_drafter_shakespeare --speculate=4 \
  --decode_batches=1
stage halt_b1_K4 170 --init_from=out/gpu/spec_halt --speculate=4 --decode_batches=1
stage exit_b8_K2 170 $exit_model --speculate=2 --decode_batches=8
stage exit_b1_K4_one_graph 170 $exit_model --speculate=4 --decode_batches=1 --one_graph=True
stages_again
