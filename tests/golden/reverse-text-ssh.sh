#!/bin/bash
# primebuild 0.1.0: reverse-text-ssh, plan 16f2b09959e83e704786fbdc71d45a7861b00aaa1f4f43992cc501c04da3366b, target ssh (rendered; do not edit)
# Each process: one ssh session, its own process group on the host. The admin token and the
# secrets go to its stdin as NAME=value lines ending with an empty line, their values taken from
# this shell's environment when it runs (never written here). Run it where the run folder is
# (a filesystem every host sees): the processes start in the plan's start order, each order once
# the previous one is healthy; a process that fails is restarted as its restart policy allows,
# otherwise every process is stopped (fail fast). Logs go to RUN_DIR/logs/NAME.log. The workers read
# RUN_DIR/plan.json and RUN_DIR/rendezvous.json (hosts, model folder, vLLM's python), as `run` writes them.
set -uo pipefail
: "${PRIMEBUILD_ADMIN_TOKEN:?set the run admin token}"
command -v curl >/dev/null || { echo "ssh.sh: curl is needed for the health checks" >&2; exit 2; }
run_dir=/shared/runs/demo
stop_grace_seconds=8 term_seconds=10  # as primebuild/runtime/supervisor.py
mkdir -p "$run_dir/logs"
declare -A pid=() exited=() restarts=() max_restarts=() health_url=() health_timeout=()
names=(inference-0 trainer orchestrator)
finishers=(trainer orchestrator)
signal_template='if tr '"'"'\0'"'"' '"'"'\n'"'"' < /proc/@PGID@/environ 2>/dev/null | grep -qxF -- PRIMEBUILD_RUN_DIR=/shared/runs/demo; then kill -@SIG@ -- -@PGID@; fi'

# inference-0 (inference) on plan node 0: 127.0.0.2
start_inference-0() {
  printf '%s\n' "PRIMEBUILD_ADMIN_TOKEN=${PRIMEBUILD_ADMIN_TOKEN-}" '' | ssh -p 2222 -o BatchMode=yes -o ServerAliveInterval=2 -o ServerAliveCountMax=5 -- 127.0.0.2 'cd /shared/runs/demo && exec "$HOME"/primebuild/.venv/bin/python -m primebuild.cli worker --plan /shared/runs/demo/plan.json --process inference-0 --run-dir /shared/runs/demo --session --env-from-stdin' >>"$run_dir/logs/"inference-0.log 2>&1 &
  pid[inference-0]=$!
}
signal_inference-0() {  # SIGNAL PGID (digits): the remote command with both filled in
  local command=${signal_template//@PGID@/$2}; ssh -p 2222 -o BatchMode=yes -o ServerAliveInterval=2 -o ServerAliveCountMax=5 -- 127.0.0.2 "${command//@SIG@/$1}" </dev/null || true
}
restarts[inference-0]=0 max_restarts[inference-0]=3 health_url[inference-0]=http://127.0.0.2:8000/health health_timeout[inference-0]=1800

# trainer (trainer) on plan node 1: 127.0.0.3
start_trainer() {
  printf '%s\n' "PRIMEBUILD_ADMIN_TOKEN=${PRIMEBUILD_ADMIN_TOKEN-}" '' | ssh -p 2222 -o BatchMode=yes -o ServerAliveInterval=2 -o ServerAliveCountMax=5 -- 127.0.0.3 'cd /shared/runs/demo && exec "$HOME"/primebuild/.venv/bin/python -m primebuild.cli worker --plan /shared/runs/demo/plan.json --process trainer --run-dir /shared/runs/demo --session --env-from-stdin' >>"$run_dir/logs/"trainer.log 2>&1 &
  pid[trainer]=$!
}
signal_trainer() {  # SIGNAL PGID (digits): the remote command with both filled in
  local command=${signal_template//@PGID@/$2}; ssh -p 2222 -o BatchMode=yes -o ServerAliveInterval=2 -o ServerAliveCountMax=5 -- 127.0.0.3 "${command//@SIG@/$1}" </dev/null || true
}
restarts[trainer]=0 max_restarts[trainer]=3 health_url[trainer]='' health_timeout[trainer]=300

# orchestrator (orchestrator) on plan node 1: 127.0.0.3
start_orchestrator() {
  printf '%s\n' "PRIMEBUILD_ADMIN_TOKEN=${PRIMEBUILD_ADMIN_TOKEN-}" '' | ssh -p 2222 -o BatchMode=yes -o ServerAliveInterval=2 -o ServerAliveCountMax=5 -- 127.0.0.3 'cd /shared/runs/demo && exec "$HOME"/primebuild/.venv/bin/python -m primebuild.cli worker --plan /shared/runs/demo/plan.json --process orchestrator --run-dir /shared/runs/demo --session --env-from-stdin' >>"$run_dir/logs/"orchestrator.log 2>&1 &
  pid[orchestrator]=$!
}
signal_orchestrator() {  # SIGNAL PGID (digits): the remote command with both filled in
  local command=${signal_template//@PGID@/$2}; ssh -p 2222 -o BatchMode=yes -o ServerAliveInterval=2 -o ServerAliveCountMax=5 -- 127.0.0.3 "${command//@SIG@/$1}" </dev/null || true
}
restarts[orchestrator]=0 max_restarts[orchestrator]=0 health_url[orchestrator]='' health_timeout[orchestrator]=300

healthy() {  # NAME URL TIMEOUT_S: alive and, when URL is given, answering 200 before the timeout
  local name=$1 url=$2 deadline=$((SECONDS + $3))
  while (( SECONDS < deadline )); do
    kill -0 "${pid[$name]:-}" 2>/dev/null || return 1
    [[ -z $url ]] && return 0
    curl -fsS -o /dev/null --max-time 2 "$url" 2>/dev/null && return 0
    sleep 1
  done
  return 1
}

signal_all() {  # SIGNAL: every process group the workers recorded, on its host
  local name pgid
  for name in "${names[@]}"; do
    pgid=$(sed -n 's/.*"pgid": *\([0-9][0-9]*\).*/\1/p' "$run_dir/pids/$name.json" 2>/dev/null || true)
    [[ -n $pgid ]] && "signal_$name" "$1" "$pgid"
  done
  return 0
}

stop_all() {
  signal_all TERM
  local deadline=$((SECONDS + term_seconds)) name
  while (( SECONDS < deadline )); do
    for name in "${names[@]}"; do kill -0 "${pid[$name]:-}" 2>/dev/null && { sleep 1; continue 2; }; done
    break
  done
  signal_all KILL
  wait
}

fail() {  # MESSAGE EXIT_CODE
  echo "error: $1; stopping every other process" >&2
  touch "$run_dir/STOP"  # the trainer saves the step it finished, the orchestrator stops
  local deadline=$((SECONDS + stop_grace_seconds)) name
  while (( SECONDS < deadline )); do
    for name in "${finishers[@]}"; do kill -0 "${pid[$name]:-}" 2>/dev/null && { sleep 1; continue 2; }; done
    break
  done
  stop_all
  exit "$2"
}

start_order() {  # NAME…: start them, then wait for each one's health
  local name
  for name in "$@"; do "start_$name"; done
  for name in "$@"; do
    healthy "$name" "${health_url[$name]}" "${health_timeout[$name]}" ||
      fail "$name did not become healthy; see $run_dir/logs/$name.log" 1
  done
}

watch() {  # until the orchestrator and the trainer exit 0
  local name code done
  while :; do
    for name in "${names[@]}"; do
      [[ -n ${exited[$name]:-} ]] && continue
      kill -0 "${pid[$name]}" 2>/dev/null && continue
      code=0; wait "${pid[$name]}" || code=$?
      if (( code == 0 )) && [[ " ${finishers[*]} " == *" $name "* ]]; then exited[$name]=0; continue; fi
      if (( code != 0 && restarts[$name] < max_restarts[$name] )); then
        restarts[$name]=$((restarts[$name] + 1))
        echo "$name exited with $code: restarting (${restarts[$name]}/${max_restarts[$name]})" >&2
        "start_$name"
        healthy "$name" "${health_url[$name]}" "${health_timeout[$name]}" ||
          fail "$name failed again after a restart; see $run_dir/logs/$name.log" 1
        continue
      fi
      exited[$name]=$code
      (( code == 0 )) && fail "$name exited before the run finished" 1
      fail "$name exited with $code; see $run_dir/logs/$name.log" "$(( code < 128 ? code : 1 ))"
    done
    done=1
    for name in "${finishers[@]}"; do [[ ${exited[$name]:-} == 0 ]] || done=0; done
    if (( done )); then stop_all; echo "run complete"; exit 0; fi
    sleep 1
  done
}

start_order inference-0  # start order 0
start_order trainer  # start order 1
start_order orchestrator  # start order 2
watch
