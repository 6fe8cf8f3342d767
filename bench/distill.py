"""On-policy distillation vs RL alone: the same reverse-text run, the same steps, with and without a teacher.

    .venv/bin/python bench/distill.py --steps 100
    .venv/bin/python bench/distill.py --steps 100 --weight 0.3 --store /tmp/store

Builds (or finds in the store) the teacher, manifests/reverse-text-teacher-sft.yaml (the wider character
model), then runs `primebuild run manifests/reverse-text.yaml` and `primebuild run
manifests/reverse-text-distill.yaml` for `--steps` steps each, one after the other, same seed, same SFT
start. Prints each one's held-out reward before and after (the orchestrator's greedy eval on 200 held-out
prompts), its gain, the distillation run's last teacher_kl, and the wall seconds of each run. The
teacher's own held-out reward is its SFT build's. Wall seconds on a shared machine are not comparable
beyond a rough cost of the teacher's server (say what else ran).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

REPO = Path(__file__).resolve().parents[1]


def primebuild(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "primebuild.cli", *args], check=True, capture_output=True, text=True,
                          env=env)


def run(manifest: str, steps: int, runs: Path, sets: list[str], env: dict) -> dict:
    out = runs / Path(manifest).stem
    started = time.monotonic()
    primebuild("run", str(REPO / "manifests" / manifest), "--runs-dir", str(out), "--quiet",
               "--set", f"orchestrator.max_steps={steps}", *sum((["--set", s] for s in sets), []), env=env)
    wall = time.monotonic() - started
    (run_dir,) = list(out.iterdir())
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    kl = [r["value"] for r in rows if r["role"] == "trainer" and r["name"] == "teacher_kl"]
    return {"before": summary["eval_reward_before"], "after": summary["eval_reward_after"],
            "gain": summary["eval_reward_gain"], "wall_s": wall, "teacher_kl_first": kl[0] if kl else None,
            "teacher_kl_last": kl[-1] if kl else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--weight", type=float, default=0.02, help="distill.weight")
    parser.add_argument("--store", default=None, help="PRIMEBUILD_STORE (default: the usual one)")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"PRIMEBUILD_STORE": args.store} if args.store else {})}
    built = primebuild("run", str(REPO / "manifests" / "reverse-text-teacher-sft.yaml"), env=env).stdout.strip()
    print(f"teacher: {built.splitlines()[-1]}")
    with TemporaryDirectory() as tmp:
        runs = Path(tmp)
        rl = run("reverse-text.yaml", args.steps, runs, [], env)
        distilled = run("reverse-text-distill.yaml", args.steps, runs, [f"distill.weight={args.weight}"], env)
    print(f"{'run':<26} {'before':>7} {'after':>7} {'gain':>8} {'teacher_kl first/last':>22} {'wall s':>7}")
    for name, r in (("RL alone", rl), (f"RL + teacher (w={args.weight})", distilled)):
        kl = "-" if r["teacher_kl_first"] is None else f"{r['teacher_kl_first']:.3f} / {r['teacher_kl_last']:.3f}"
        print(f"{name:<26} {r['before']:>7.4f} {r['after']:>7.4f} {r['gain']:>+8.4f} {kl:>22} {r['wall_s']:>7.0f}")


if __name__ == "__main__":
    main()
