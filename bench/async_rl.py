"""Async vs synchronous RL on the embedded default: the same manifest and step count, two run modes.

    .venv/bin/python bench/async_rl.py [--steps 40] [--off 2]

Runs `primebuild run manifests/reverse-text.yaml` with `max_off_policy_steps: 0` (synchronous: the
inference server waits while the trainer steps, and vice versa) and with `--off` (the orchestrator
samples step k while the trainer trains step k-1..k-off). Prints the wall time of the RL loop per mode,
their ratio, and where the time goes: the trainer's idle fraction (waiting for a batch) and the
inference side's idle fraction (the orchestrator waiting for weights). Evaluation is shrunk to a few
prompts so that it does not dilute the comparison; the SFT model comes from the store (built once).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from tempfile import TemporaryDirectory

REPO = Path(__file__).resolve().parents[1]


def run(mode_off: int, steps: int, runs: Path) -> dict:
    out = runs / f"off{mode_off}"
    cmd = [sys.executable, "-m", "primebuild.cli", "run", str(REPO / "manifests" / "reverse-text.yaml"),
           "--runs-dir", str(out), "--quiet", "--set", f"orchestrator.max_steps={steps}",
           "--set", f"orchestrator.max_off_policy_steps={mode_off}", "--set", "orchestrator.eval_prompts=8"]
    subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    (run_dir,) = list(out.iterdir())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]

    def values(role: str, name: str) -> list[tuple[int, float, float]]:
        return [(r["step"], r["value"], r.get("time", 0.0)) for r in rows if r["role"] == role and r["name"] == name]

    trainer_wait = sum(v for _, v, _ in values("trainer", "wait_s"))
    trainer_busy = sum(v for _, v, _ in values("trainer", "step_s")) + sum(v for _, v, _ in values("trainer", "publish_s"))
    orch_wait = sum(v for _, v, _ in values("orchestrator", "wait_seconds"))
    generation = sum(v for _, v, _ in values("orchestrator", "generation_seconds"))
    loop = trainer_wait + trainer_busy  # the trainer's loop covers the RL steps from first wait to last step
    return {
        "off": mode_off, "steps": steps, "rl_loop_seconds": loop,
        "trainer_idle_fraction": trainer_wait / loop if loop else 0.0,
        "inference_idle_fraction": orch_wait / (orch_wait + generation) if generation else 0.0,
        "generation_seconds": generation, "train_seconds": trainer_busy,
        "wall_seconds": json.loads((run_dir / "summary.json").read_text())["wall_seconds"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--off", type=int, default=2)
    args = parser.parse_args()
    with TemporaryDirectory() as tmp:
        sync = run(0, args.steps, Path(tmp))
        asyn = run(args.off, args.steps, Path(tmp))
    print(f"{'mode':<22}{'RL loop s':>10}{'wall s':>9}{'trainer idle':>14}{'inference idle':>16}{'gen s':>8}{'train s':>9}")
    for name, r in (("sync (off 0)", sync), (f"async (off {args.off})", asyn)):
        print(f"{name:<22}{r['rl_loop_seconds']:>10.1f}{r['wall_seconds']:>9.1f}{r['trainer_idle_fraction']:>14.0%}"
              f"{r['inference_idle_fraction']:>16.0%}{r['generation_seconds']:>8.1f}{r['train_seconds']:>9.1f}")
    print(f"speed-up of the RL loop, async vs sync: {sync['rl_loop_seconds'] / asyn['rl_loop_seconds']:.2f}x "
          f"({args.steps} steps)")


if __name__ == "__main__":
    main()
