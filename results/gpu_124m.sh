# A trained exit drafter at the GPT-2 124M shape and its compiled self-speculative decoding on one
# GPU, in one command (about 9 minutes on an H200: an estimate, never run on a GPU yet):
#
#   bash results/gpu_124m.sh FOLDER [SECONDS]
#
# First trains config/exit_drafter_124m_fineweb.py (12 layers, d = 768, GPT-2 BPE, exits after {2,
# 6, 9} blocks) on the FineWeb sample into out/exit_drafter_124m_fineweb, its output in
# FOLDER/train_log.txt and its metrics.jsonl, config.json and run_info.json (its command and commit)
# copied to FOLDER (the checkpoint, 1.5 GB with its optimizer state, stays). The training gets
# TRAIN_SECONDS (270; less where SECONDS leaves less) and, stopped then, saves where it is (train.py
# stops on SIGTERM with a checkpoint); a checkpoint already there is resumed instead (a finished
# run's at once). Then the stages of results/speculative_stages.sh on it, batch 1, greedy: the draft
# of 6 blocks at K = 4, the draft of 2 blocks at K = 4, 6 blocks at K = 2, each stopped at its limit
# or at what is left of SECONDS (560). Compiled code is kept in $COMPILE_CACHE
# (out/compile_cache_gpu.bin).
# On a lent GPU, whose lease returns at most 8 files: PACK=$OUT/r124.tgz bash results/gpu_124m.sh
# /tmp/r124 540 (the folder packed into one archive when the script ends).
# Needs data/fineweb_edu, made here (no network) with
#   python data/prepare.py fineweb_edu --input=../shared/data/fineweb_sample_legal.parquet
# (8.7 MB: carry it), and stops before any work without it.
set -u
folder=${1:?usage: bash results/gpu_124m.sh FOLDER [SECONDS]}
source "$(dirname "$0")/speculative_stages.sh"
require_files "make it with python data/prepare.py fineweb_edu \
--input=../shared/data/fineweb_sample_legal.parquet and carry data/fineweb_edu" \
  data/fineweb_edu/{train.bin,val.bin,meta.json}
end=${2:-560}
cache=${COMPILE_CACHE:-out/compile_cache_gpu.bin}
start_log
run=out/exit_drafter_124m_fineweb
# a fresh run (--overwrite: one killed before its first checkpoint left its other files, no
# ckpt.pt), or the stopped or finished one continued (a finished run says so and stops at once)
start=--overwrite=True
[ -f "$run/ckpt.pt" ] && start=--init_from=resume
limit=${TRAIN_SECONDS:-270}; left=$((end - SECONDS - 60)); [ $left -lt $limit ] && limit=$left
echo "=== $(date +%T) t=${SECONDS}s training ($start), limit ${limit} s" | tee -a "$log"
timeout -k 60 $limit python3 train.py config/exit_drafter_124m_fineweb.py $start \
  >> "$folder/train_log.txt" 2>&1
rc=$?
tail -n 4 "$folder/train_log.txt" | tee -a "$log"
echo "=== training: rc=$rc t=${SECONDS}s" | tee -a "$log"
for f in metrics.jsonl config.json run_info.json; do
  [ -f "$run/$f" ] && cp "$run/$f" "$folder/"
done
if [ ! -f "$run/ckpt.pt" ]; then echo "=== no checkpoint: no stages" | tee -a "$log"; exit 1; fi
stage exit124m_E6_b1_K4 200 --init_from=$run --draft_layers=6 --speculate=4 --decode_batches=1
stage exit124m_E2_b1_K4 170 --init_from=$run --draft_layers=2 --speculate=4 --decode_batches=1
stage exit124m_E6_b1_K2 170 --init_from=$run --draft_layers=6 --speculate=2 --decode_batches=1
stages_again
