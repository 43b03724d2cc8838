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
# Needs the checkpoints out/gpu/<name> (optimizer-free copies of the runs in docs/results.md: bash
# results/gpu_checkpoints.sh makes them on the CPU) and data/shakespeare_char (the prompts), and
# stops before any work if one is missing.
set -u
folder=${1:?usage: bash results/gpu_speculative.sh FOLDER [SECONDS]}
missing=
for name in spec_exit_w4d2 spec_mod spec_halt ffn_distilled_drafter_shakespeare; do
  [ -f "out/gpu/$name/ckpt.pt" ] || missing="$missing out/gpu/$name/ckpt.pt"
done
for name in val.bin meta.json; do
  [ -f "data/shakespeare_char/$name" ] || missing="$missing data/shakespeare_char/$name"
done
if [ -n "$missing" ]; then
  echo "gpu_speculative.sh: no$missing; make them with bash results/gpu_checkpoints.sh" \
    "(on the CPU, 30-45 minutes) and carry out/gpu and data/shakespeare_char" >&2
  exit 2
fi
end=${2:-540}
cache=${COMPILE_CACHE:-out/compile_cache_gpu.bin}
mkdir -p "$folder"
log=$folder/log.txt
export PYTHONUNBUFFERED=1
stopped=()
stage() {
  local name=$1 limit=$2; shift 2
  local left=$((end - SECONDS)); [ $left -lt $limit ] && limit=$left
  if [ $limit -lt 30 ]; then echo "=== $name: skipped, ${left} s left" | tee -a "$log"; return; fi
  echo "=== $(date +%T) t=${SECONDS}s $name, limit ${limit} s" | tee -a "$log"
  timeout -k 5 $limit python3 bench.py "$@" --decode_prompt=64 --decode_tokens=60 \
    --bench_steps=10 --compile=True --compile_cache="$cache" --passes_per_graph=1,4 \
    --out="$folder/speculative_$name.json" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc t=${SECONDS}s" | tee -a "$log"
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then stopped+=("$name 9999 $*"); fi
}
echo "commit $(git rev-parse HEAD 2>/dev/null || echo unknown)" | tee -a "$log"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" 2>&1 | tee -a "$log"
exit_model="--init_from=out/gpu/spec_exit_w4d2 --draft_layers=2"
# first the stages no GPU has measured (results/h200_2026-11-27/gpu_speculative/ has the exit and
# mod stages at batch 1), then those again (exit at K = 4 with each pass one graph, --one_graph,
# beside 4 chained); a cold stage took about 150 s there (a plain step's warm-up 22 s, passes
# apart 20 s, 4 chained 83-101 s, unrolled then), so a limit below 170 s may stop it unfinished
stage ffn_b1_K4 170 --init_from=out/gpu/ffn_distilled_drafter_shakespeare --speculate=4 \
  --decode_batches=1
stage halt_b1_K4 170 --init_from=out/gpu/spec_halt --speculate=4 --decode_batches=1
stage exit_b8_K2 170 $exit_model --speculate=2 --decode_batches=8
stage exit_b1_K4_one_graph 170 $exit_model --speculate=4 --decode_batches=1 --one_graph=True
stage mod_b1_K4 170 --init_from=out/gpu/spec_mod --speculate=4 --decode_batches=1
stage exit_b1_K2 180 $exit_model --speculate=2 --decode_batches=1 --profile=True
again=(${stopped[@]+"${stopped[@]}"})      # (bash before 4.4 calls an empty array unbound)
stopped=()
for s in ${again[@]+"${again[@]}"}; do
  stage $s        # (split into words on purpose: a stage's name, limit and options)
done
