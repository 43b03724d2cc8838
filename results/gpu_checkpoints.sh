# The checkpoints results/gpu_speculative.sh decodes with, trained on this machine:
#
#   bash results/gpu_checkpoints.sh [LOG]
#
# The six trained 8-layer Shakespeare models of docs/results.md (exit, mod, halt, ffn with a
# draft distilled after training, ensemble and dense), trained with the commands their runs were
# trained with and copied without their optimizer state to out/gpu/<name>, 38 MB in all, small
# enough to travel with the tree to a GPU machine (`carry`). JOBS of them train at once, with a
# thread each: 2 on the CPU (60-75 minutes on 2 cores), all 6 where torch sees a GPU (there,
# device and dtype as train.py picks them: bf16 autocast on a recent GPU; never timed on one). A
# model whose copy is already there is not trained again; a training stopped part way resumes from
# its last checkpoint. Only a finished run is copied. A SIGTERM or Ctrl-C stops the trainings in
# flight, each with a checkpoint, and the script waits for them before it exits (143 or 130).
# Output goes to LOG (out/gpu/train_log.txt).
set -eu
source "$(dirname "$0")/speculative_stages.sh"
mkdir -p out/gpu
log=${1:-out/gpu/train_log.txt}
if [ -z "${JOBS:-}" ]; then
  JOBS=2
  torch_sees_gpu && JOBS=6
fi
# (where it is there, as carried to a GPU machine that has no ../shared/data to make it from)
[ -f data/shakespeare_char/meta.json ] || python3 data/prepare.py shakespeare_char >> "$log" 2>&1
base=config/exit_drafter_shakespeare.py

# train NAME [train.py options]: out/NAME trained, then its optimizer-free copy in out/gpu/NAME
train() {
  local name=$1; shift
  if [ -f "out/gpu/$name/ckpt.pt" ]; then echo "$name: out/gpu/$name is there" >> "$log"; return; fi
  local start=--overwrite=True         # (a folder a stopped run left without a checkpoint)
  [ -f "out/$name/ckpt.pt" ] && start=--init_from=resume     # (a finished run: just stops)
  echo "=== $(date +%T) $name: python3 train.py $* $start" >> "$log"
  OMP_NUM_THREADS=1 python3 train.py "$@" $start >> "$log" 2>&1
  python3 - "out/$name" "out/gpu/$name" >> "$log" 2>&1 <<'EOF'
import shutil, sys
from pathlib import Path
from checkpoint import load_checkpoint, save_checkpoint
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
import sweep
if not sweep.finished(src):               # stopped by a signal: its next run resumes it
    sys.exit(f"{src}: the run did not finish: not copied (run this script again to resume it)")
ckpt = load_checkpoint(src / 'ckpt.pt')
ckpt['optimizer'] = None                  # (what run_state reads for a run without one)
dst.mkdir(parents=True, exist_ok=True)
for extra in ('config.json', 'run_info.json'):
    if (src / extra).exists():
        shutil.copy(src / extra, dst / extra)
save_checkpoint(dst / 'ckpt.pt', ckpt)    # last: its presence says the copy is whole
print(f"{dst}: copied without the optimizer state")
EOF
}

# each model, in the order they start; the distilled ffn draft needs the ffn run first
exit_model() {
  train spec_exit_w4d2 $base --exit_weight=4.0 --layer_dropout=0.2 --out_dir=out/spec_exit_w4d2
}
ffn_models() {
  if [ ! -f out/gpu/ffn_distilled_drafter_shakespeare/ckpt.pt ]; then
    train spec_ffn $base --route=ffn --ffn_gate=mlp --ffn_budget=0.5 --ffn_layers=all \
      --layer_dropout=0.0 --out_dir=out/spec_ffn
  fi
  train ffn_distilled_drafter_shakespeare config/ffn_distilled_drafter_shakespeare.py \
    --init_from=out/spec_ffn/ckpt.pt
}
mod_model() {
  train spec_mod $base --route=mod --mod_capacity=0.125 --layer_dropout=0.0 --out_dir=out/spec_mod
}
halt_model() {
  train spec_halt $base --route=halt --halt_lambda=0.05 --layer_dropout=0.0 --out_dir=out/spec_halt
}
ensemble_model() {
  train spec_ensemble $base --route=ensemble --layer_dropout=0.0 --out_dir=out/spec_ensemble
}
dense_model() {
  train spec_dense $base --route=none --layer_dropout=0.0 --out_dir=out/spec_dense
}

# a SIGTERM (a `timeout`'s, to the whole process group) or Ctrl-C: no more trainings; the ones in
# flight (which the signal stops, each at its next step with a checkpoint) are waited for, so that
# none runs on once the script has returned
pgroup() { sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f3; }  # (after "(name) ")
group=$(pgroup $$)
trainings() {                    # the train.py processes of this script's process group
  local d
  for d in /proc/[0-9]*; do
    [ "$(pgroup "${d#/proc/}")" = "$group" ] || continue
    tr '\0' ' ' < "$d/cmdline" 2>/dev/null | grep -q 'train\.py' && echo "${d#/proc/}"
  done
  return 0
}
stopping() {
  trap '' TERM INT
  local left; left=$(trainings)
  [ -z "$left" ] || kill -TERM $left 2>/dev/null || true
  while [ -n "$(trainings)" ]; do sleep 1; done
  echo "=== $(date +%T) stopped by a signal" >> "$log"
  exit "$1"
}
trap 'stopping 143' TERM
trap 'stopping 130' INT

# JOBS at a time, each started as one ends (9-19 minutes a model on one core,
# results/cpu_2026-11-2[78]/)
echo "=== $(date +%T) $JOBS at a time" >> "$log"
running() {
  local n=0 pid
  for pid in ${pids[@]+"${pids[@]}"}; do kill -0 "$pid" 2>/dev/null && n=$((n + 1)); done
  echo $n
}
pids=()
for models in exit_model ffn_models mod_model halt_model ensemble_model dense_model; do
  while [ "$(running)" -ge "$JOBS" ]; do sleep 0.2; done
  $models &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done    # (bash keeps each one's status)
rm -rf out/gpu/spec_ffn          # (only the distilled model's copy is decoded)
echo "=== $(date +%T) done, status $status" >> "$log"
du -sh out/gpu/* >> "$log" 2>&1 || true
exit $status
