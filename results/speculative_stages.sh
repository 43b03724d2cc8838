# Sourced by results/gpu_speculative.sh and results/gpu_124m.sh, which set `folder` (where the
# JSON and log.txt go), `end` (the second of the script's clock, bash's SECONDS, by which every
# stage must be done) and `cache` (the compile cache's file), and by results/gpu_checkpoints.sh
# (torch_sees_gpu); sourcing it defines these and does nothing else:
#
#   missing_files FILE...               the FILEs that are not there, each after a space
#   require_files HOW FILE...           exit 2 before any work, naming the missing FILEs and HOW
#                                       to make them, where one is missing
#   torch_sees_gpu                      status 0 where torch sees a GPU
#   start_log                           FOLDER made; the commit, torch and the GPU into its log.txt;
#                                       with PACK=FILE.tgz set, FOLDER packed into that archive
#                                       when the script ends (a GPU lease returns a few files)
#   stage NAME LIMIT BENCH_OPTIONS...   one bench.py --speculate process: greedy, 60 tokens from
#                                       64-token prompts, 10 repeats a side, both sides compiled,
#                                       passes apart and 4 chained in one graph timed in the same
#                                       process, writing $folder/speculative_NAME.json
#                                       (.partial.json if stopped first), stopped at LIMIT seconds
#                                       or at what is left before `end`, skipped under 30 or
#                                       where its --init_from folder holds no ckpt.pt
#   stages_again                        the stages stopped at their limit, again, in order, with
#                                       the time left: each starts from the code it compiled
#
# Compiled code is kept in $cache by every stage, also one that is stopped (bench.py saves it on
# SIGTERM): a machine that starts bare then compiles only what no run kept.
missing_files() {
  local f
  for f in "$@"; do [ -f "$f" ] || printf ' %s' "$f"; done
}
require_files() {
  local how=$1 missing; shift
  missing=$(missing_files "$@")
  if [ -n "$missing" ]; then echo "$(basename "$0"): no$missing; $how" >&2; exit 2; fi
}
torch_sees_gpu() {
  python3 -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null
}
start_log() {
  mkdir -p "$folder"
  if [ -n "${PACK:-}" ]; then
    trap 'tar czf "$PACK" -C "$(dirname "$folder")" "$(basename "$folder")"' EXIT
  fi
  log=$folder/log.txt
  export PYTHONUNBUFFERED=1
  echo "commit $(git rev-parse HEAD 2>/dev/null || echo unknown)" | tee -a "$log"
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" 2>&1 | tee -a "$log"
}
stopped=()
stage() {
  local name=$1 limit=$2; shift 2
  local a
  for a in "$@"; do case "$a" in --init_from=*)
    if [ ! -f "${a#--init_from=}/ckpt.pt" ]; then
      echo "=== $name: skipped, no ${a#--init_from=}/ckpt.pt" | tee -a "$log"; return
    fi;;
  esac; done
  local left=$((end - SECONDS)); [ $left -lt $limit ] && limit=$left
  if [ $limit -lt 30 ]; then echo "=== $name: skipped, ${left} s left" | tee -a "$log"; return; fi
  echo "=== $(date +%T) t=${SECONDS}s $name, limit ${limit} s" | tee -a "$log"
  local json=$folder/speculative_$name.json started=$folder/.started_$name
  touch "$started"
  timeout -k 5 $limit python3 bench.py "$@" --decode_prompt=64 --decode_tokens=60 \
    --bench_steps=10 --compile=True --compile_cache="$cache" --passes_per_graph=1,4 \
    --out="$json" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc t=${SECONDS}s" | tee -a "$log"
  # stopped at its limit, unless only while saving the compile cache after its final JSON: one
  # not older than the stage's start mark (a file system's clock ticks in milliseconds, so a JSON
  # written soon after the mark can carry the mark's very time)
  local wrote=no
  [ -f "$json" ] && ! [ "$started" -nt "$json" ] && wrote=yes
  if { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && [ $wrote = no ]; then
    stopped+=("$name 9999 $*")
  fi
  rm -f "$started"
}
stages_again() {
  local again=(${stopped[@]+"${stopped[@]}"})   # (bash before 4.4 calls an empty array unbound)
  stopped=()
  for s in ${again[@]+"${again[@]}"}; do
    stage $s      # (split into words on purpose: a stage's name, limit and options)
  done
}
