#!/bin/bash
# primebuild 0.1.0: reverse-text-ssh, plan 4424d2bc9cd074383154ea1d6f9e0afeeb82b64fc208058e7932dbf3a4bd62ce, target ssh (rendered; do not edit)
# Each process: one ssh session, its own process group on the host. The admin token and the
# secrets go to its stdin as NAME=value lines ending with an empty line, their values taken from
# this shell's environment when it runs (never written here).
set -euo pipefail
: "${PRIMEBUILD_ADMIN_TOKEN:?set the run admin token}"

# inference-0 (inference) on plan node 0: 127.0.0.2
printf '%s\n' "PRIMEBUILD_ADMIN_TOKEN=${PRIMEBUILD_ADMIN_TOKEN-}" '' | ssh -p 2222 -o BatchMode=yes 127.0.0.2 'cd /shared/runs/demo && "$HOME"/primebuild/.venv/bin/python -m primebuild.cli worker --plan /shared/runs/demo/plan.json --process inference-0 --run-dir /shared/runs/demo --session --env-from-stdin; exit $?' &
# trainer (trainer) on plan node 1: 127.0.0.3
printf '%s\n' "PRIMEBUILD_ADMIN_TOKEN=${PRIMEBUILD_ADMIN_TOKEN-}" '' | ssh -p 2222 -o BatchMode=yes 127.0.0.3 'cd /shared/runs/demo && "$HOME"/primebuild/.venv/bin/python -m primebuild.cli worker --plan /shared/runs/demo/plan.json --process trainer --run-dir /shared/runs/demo --session --env-from-stdin; exit $?' &
# orchestrator (orchestrator) on plan node 1: 127.0.0.3
printf '%s\n' "PRIMEBUILD_ADMIN_TOKEN=${PRIMEBUILD_ADMIN_TOKEN-}" '' | ssh -p 2222 -o BatchMode=yes 127.0.0.3 'cd /shared/runs/demo && "$HOME"/primebuild/.venv/bin/python -m primebuild.cli worker --plan /shared/runs/demo/plan.json --process orchestrator --run-dir /shared/runs/demo --session --env-from-stdin; exit $?' &
wait
