#!/usr/bin/env bash
# GPU acceptance: what the GPU plans promise, measured on one GPU machine in at most 8 minutes, without
# a download (models are built from the architecture facts in manifests/models/, random weights).
#
#     bash bench/gpu_acceptance.sh                    # every step, results in $OUT (or ./gpu-acceptance)
#     bash bench/gpu_acceptance.sh --steps trainer_mfu,nccl_broadcast
#     bash bench/gpu_acceptance.sh --dry-run          # on CPU (CI): checks every step without a GPU
#
# Steps (each under its own time limit; the results of each land in OUT/<step>.json, its log beside it):
#   vllm_main       bench/gpu_acceptance.py job vllm_main: an RL run (reverse-text-vllm) with vLLM, the
#                   CUDA wheel, as the inference engine: rollout tokens/s, trainer step seconds
#   fp8_moe_decode  bench/gpu.py engine_fp8: FP8 block-scaled vs bf16 decode of a ~1B Qwen3-MoE
#   trainer_mfu     bench/gpu.py trainer_large: the trainer's MFU on the Qwen3-1.7B shape
#   nccl_broadcast  bench/weight_broadcast.py: the weight sync's NCCL broadcast, GB/s (needs 2 GPUs)
#   mismatch_r3     bench/gpu_acceptance.py job mismatch_r3: mismatch KL with and without router replay
#                   (R3) of the routes vLLM returns, on a tiny Qwen3-MoE
#
# The vLLM steps need the CUDA vLLM environment (`scripts/vllm-env --gpu`, made once with network; give
# PRIMEBUILD_ENVS where it lies). The script exits 0 only when every step it ran passed.
#
# --dry-run runs nothing on a GPU: it parses the arguments, checks that every step's interpreter and
# scripts resolve and compile, that bench/gpu.py and bench/weight_broadcast.py parse their arguments,
# compiles the plans of both RL jobs (and checks they select the CUDA vLLM wheel, routed experts on for
# R3), and runs the weight broadcast for real over gloo on CPU with a small payload.
set -uo pipefail
cd "$(dirname "$0")/.."

all_steps=(vllm_main fp8_moe_decode trainer_mfu nccl_broadcast mismatch_r3)
declare -A limit_s=([vllm_main]=120 [fp8_moe_decode]=75 [trainer_mfu]=90 [nccl_broadcast]=45 [mismatch_r3]=110)
total_limit_s=480

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; }

dry_run=0
steps_arg=$(IFS=,; echo "${all_steps[*]}")
out_dir=${OUT:-$PWD/gpu-acceptance}
while (( $# )); do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --steps) [[ $# -ge 2 ]] || { echo "--steps needs a value" >&2; exit 2; }; steps_arg=$2; shift ;;
    --steps=*) steps_arg=${1#--steps=} ;;
    --out) [[ $# -ge 2 ]] || { echo "--out needs a value" >&2; exit 2; }; out_dir=$2; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_acceptance: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
IFS=, read -r -a steps <<<"$steps_arg"
for step in "${steps[@]}"; do
  [[ -n ${limit_s[$step]:-} ]] || { echo "gpu_acceptance: unknown step '$step' (steps: ${all_steps[*]})" >&2; exit 2; }
done
planned=0
for step in "${steps[@]}"; do planned=$((planned + limit_s[$step])); done
(( planned <= total_limit_s )) || { echo "gpu_acceptance: steps' limits add to ${planned} s > ${total_limit_s} s" >&2; exit 2; }

py=${PYTHON:-python3}
[[ -x .venv/bin/python && -z ${PYTHON:-} ]] && py=.venv/bin/python
command -v "$py" >/dev/null || { echo "gpu_acceptance: no python ($py)" >&2; exit 2; }
mkdir -p "$out_dir"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

vllm_python() {  # the CUDA vLLM environment's python, or nothing
  scripts/vllm-env --gpu --check 2>/dev/null | tail -n 1
}

# One command per step; "$1" is the step's results file.
step_vllm_main() {
  local vllm; vllm=$(vllm_python)
  "$py" bench/gpu_acceptance.py job vllm_main ${vllm:+--vllm-python "$vllm"} --runs-dir "$out_dir/runs" --out "$1"
}
step_fp8_moe_decode() { "$py" bench/gpu.py --sections env,engine_fp8 --out "$1"; }
step_trainer_mfu() { "$py" bench/gpu.py --sections env,trainer_large --out "$1"; }
step_nccl_broadcast() { "$py" bench/weight_broadcast.py --backend nccl --gib 2 --out "$1"; }
step_mismatch_r3() {
  local vllm; vllm=$(vllm_python)
  "$py" bench/gpu_acceptance.py job mismatch_r3 ${vllm:+--vllm-python "$vllm"} --runs-dir "$out_dir/runs" --out "$1"
}

dry_check() {  # what each step relies on, checked on CPU
  local failed=0 file
  for file in bench/gpu.py bench/gpu_acceptance.py bench/weight_broadcast.py; do
    "$py" -m py_compile "$file" || { echo "dry-run: $file does not compile" >&2; failed=1; }
  done
  [[ -x scripts/vllm-env ]] && bash -n scripts/vllm-env || { echo "dry-run: scripts/vllm-env" >&2; failed=1; }
  for step in "${steps[@]}"; do
    local bad=0
    declare -F "step_$step" >/dev/null || { echo "dry-run: no command for $step" >&2; failed=1; continue; }
    case "$step" in
      fp8_moe_decode|trainer_mfu) "$py" bench/gpu.py --help >/dev/null || { echo "dry-run: bench/gpu.py --help" >&2; bad=1; } ;;
      vllm_main|mismatch_r3)
        "$py" bench/gpu_acceptance.py job "$step" --dry-run --out "$out_dir/$step.json" >"$out_dir/$step.log" 2>&1 \
          || { echo "dry-run: $step: its plan does not hold (see $out_dir/$step.log)" >&2; bad=1; } ;;
      nccl_broadcast)  # the same code path over gloo, for real
        "$py" bench/weight_broadcast.py --backend gloo --ranks 2 --gib 0.02 --tensor-mib 1 --repeats 1 \
          --out "$out_dir/$step.json" >"$out_dir/$step.log" 2>&1 \
          || { echo "dry-run: $step over gloo failed (see $out_dir/$step.log)" >&2; bad=1; } ;;
    esac
    (( bad )) && failed=1
    echo "dry-run: $step $( (( bad )) && echo FAILED || echo ok): $(declare -f "step_$step" | grep -m1 -o '"$py" .*' | sed 's/;$//')"
  done
  return $failed
}

if (( dry_run )); then
  dry_check && { echo "dry-run: every step checks out"; exit 0; }
  exit 1
fi

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv >"$out_dir/nvidia_smi.txt" 2>&1
started=$SECONDS
declare -A status=()
for step in "${steps[@]}"; do
  left=$((total_limit_s - (SECONDS - started)))
  limit=$(( limit_s[$step] < left ? limit_s[$step] : left ))
  (( limit > 5 )) || { status[$step]="skipped: no time left"; continue; }
  echo "=== $step (limit ${limit} s)"
  # SIGINT first: bench/gpu.py keeps what it measured; the functions run in a subshell so timeout can end them
  timeout --signal=INT --kill-after=15 "$limit" bash -c "$(declare -f "step_$step" vllm_python); py=$(printf %q "$py"); \
    out_dir=$(printf %q "$out_dir"); step_$step $(printf %q "$out_dir/$step.json")" >"$out_dir/$step.log" 2>&1
  rc=$?
  case $rc in
    0) status[$step]=passed ;;
    3) status[$step]="not measurable here (see $step.json)" ;;
    124) status[$step]="time limit (${limit} s)" ;;
    *) status[$step]="failed ($rc; see $step.log)" ;;
  esac
  echo "$step: ${status[$step]} in $((SECONDS - started)) s so far"
done

echo "=== summary ($out_dir)"
failed=0
for step in "${steps[@]}"; do
  echo "  $step: ${status[$step]}"
  [[ ${status[$step]} == passed ]] || failed=1
done
exit $failed
