"""Time to recover from a killed trainer: trainer-only restart vs a whole-run resume.

    .venv/bin/python bench/trainer_restart.py                                  # the embedded main job
    .venv/bin/python bench/trainer_restart.py --manifest manifests/reverse-text-vllm.yaml
    .venv/bin/python bench/trainer_restart.py --weight-sync broadcast                     # glm5's mode

Runs `primebuild run MANIFEST` twice with the same settings (checkpoint every 3 steps), SIGKILLs the
trainer once step `--kill-after` is trained, and times from the kill to

- the first trainer step recorded after it (a retrained one: the steps after the checkpoint come again),
- the first *new* step (one not trained before the kill): the run is back where it was and moving on.

`trainer-only`: the plan's default, `trainer.max_restarts: 3`: the supervisor restarts the trainer alone
(primebuild/runtime/supervisor.py); the inference servers keep their model, the orchestrator its rollouts.
`whole-run`: `trainer.max_restarts: 0` and `primebuild run --max-restarts 1`: the session fails fast
(every process stopped) and is resumed from the newest checkpoint at once, as `run --resume` does, so
the servers load the model again. The saving is that reload (and the processes' start-up). Evaluation
is shrunk to 8 prompts and only runs before RL; the SFT model comes from the store (built once).

`--weight-sync broadcast`: the trainer's rank 0 sends every step over a torch.distributed group and hosts
its store, so the kill takes the store down too; trainer-only, the restarted rank 0 hosts it again on the
same port and the servers rejoin (primebuild/runtime/weight_sync/broadcast.py). `--keep DIR` keeps the
run folders there.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

from primebuild.contracts.run_dir import RunDir
from primebuild.runtime.hang_watchdog import run_processes
from primebuild.runtime.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
MODES = {"trainer-only": [], "whole-run": ["--set", "trainer.max_restarts=0", "--max-restarts", "1"]}


def trainer_rows(run_dir: Path) -> list[int]:
    """The step of every trainer `loss` line, in file order (a retrained step comes twice)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue  # a line being written
        if r["role"] == "trainer" and r["name"] == "loss":
            rows.append(r["step"])
    return rows


def measure(manifest: Path, mode: str, runs: Path, steps: int, kill_after: int, port: int, sync: str) -> dict:
    broadcast = ["--set", "weight_sync.mode=broadcast", "--set", f"weight_sync.port={port + 1}"]
    argv = [sys.executable, "-m", "primebuild.cli", "run", str(manifest), "--runs-dir", str(runs), "--quiet",
            "--set", f"orchestrator.max_steps={steps}", "--set", "trainer.checkpoint_every=3",
            "--set", "orchestrator.rollouts_per_step=32", "--set", "orchestrator.eval_prompts=8",
            "--set", "orchestrator.eval_every=0", "--set", f"inference.port={port}", *MODES[mode],
            *(broadcast if sync == "broadcast" else [])]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        run_dir = None
        while run_dir is None or kill_after not in trainer_rows(run_dir):
            if proc.poll() is not None:
                raise RuntimeError(f"{mode}: the run ended before step {kill_after}: {proc.stdout.read()[-3000:]}")
            made = [p for p in runs.iterdir() if p.is_dir()] if runs.exists() else []
            run_dir = made[0] if made else None
            time.sleep(0.05)
        servers = sorted(p.pid for p in run_processes(RunDir(run_dir)) if p.process.startswith("inference"))
        trainers = [p.pid for p in run_processes(RunDir(run_dir)) if p.process == "trainer"]
        before = len(trainer_rows(run_dir))
        for pid in trainers:
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        trained_before = max(read_metrics(run_dir / "metrics.jsonl", role="trainer"))
        first_row = new_step = None
        while new_step is None:
            rows = trainer_rows(run_dir)
            if first_row is None and len(rows) > before:
                first_row = time.monotonic() - killed
            if any(s > trained_before for s in rows[before:]):
                new_step = time.monotonic() - killed
            if proc.poll() is not None and new_step is None:
                raise RuntimeError(f"{mode}: the run ended: {proc.stdout.read()[-3000:]}")
            time.sleep(0.05)
        servers_after = sorted(p.pid for p in run_processes(RunDir(run_dir)) if p.process.startswith("inference"))
        out, _ = proc.communicate(timeout=1800)
    finally:
        if proc.poll() is None:
            proc.kill()
    if proc.returncode != 0:
        raise RuntimeError(f"{mode}: exit {proc.returncode}: {out[-3000:]}")
    assert sorted(read_metrics(run_dir / "metrics.jsonl", role="trainer")) == list(range(1, steps + 1))
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    return {"mode": mode, "weight_sync": sync, "killed_after_step": trained_before, "first_step_s": round(first_row, 1),
            "new_step_s": round(new_step, 1), "servers_kept": servers == servers_after,
            # broadcast, trainer-only: retrained steps the servers held, so not sent again
            "not_sent_again": trainer_log.count("not sent again"),
            "load_average": round(os.getloadavg()[0], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--manifest", type=Path, default=REPO / "manifests" / "reverse-text.yaml")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--kill-after", type=int, default=4, help="kill the trainer once this step is trained")
    parser.add_argument("--port", type=int, default=8310)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--weight-sync", choices=("filesystem", "broadcast"), default="filesystem")
    parser.add_argument("--keep", type=Path, help="keep the run folders under this folder")
    args = parser.parse_args()
    results = []
    with TemporaryDirectory() as tmp:
        for mode in args.modes:
            runs = (args.keep or Path(tmp)) / f"{mode}-{args.weight_sync}"
            result = measure(args.manifest, mode, runs, args.steps, args.kill_after, args.port, args.weight_sync)
            print(json.dumps(result), flush=True)
            results.append(result)
    print(f"\n{args.manifest.name}, {args.weight_sync} weight sync: trainer SIGKILLed after step {args.kill_after} (checkpoint every 3 steps)")
    print("| mode | kill -> first step trained | kill -> first new step | inference servers kept |")
    print("|---|---:|---:|---|")
    for r in results:
        print(f"| {r['mode']} | {r['first_step_s']} s | {r['new_step_s']} s | {'yes' if r['servers_kept'] else 'no'} |")


if __name__ == "__main__":
    main()
