"""How a two-environment run's trained groups split over its environments, batch by batch.

    .venv/bin/python bench/env_split.py --workspace DIR --steps 12
    .venv/bin/python bench/env_split.py --workspace DIR --steps 12 --code /path/to/other/checkout
    .venv/bin/python bench/env_split.py --workspace DIR --steps 12 --report RUN_DIR   # a finished run

Runs manifests/reverse-text-mix.yaml (reverse-text, one turn, and long-tail, several turns with a tool
latency, weights 3:1) shrunk to 32 rollouts (4 groups) per step, asynchronous (max_off_policy_steps 1
unless --set says otherwise), with the code of `--code` (default: this checkout) on PYTHONPATH, and
prints each batch's groups per environment (read from the batch files: every sample names its
environment), each environment's share of all trained groups next to its weight's share, and the mean
generation seconds per step (what holding the split may cost: the batch waits for the slow environment).

`--workspace` holds manifests/ (with the SFT manifest the mix starts from) and store/ (where that SFT is
built: a test session's short-sft folder, tests/conftest.py short_sft_store, works as it is).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MANIFEST = "reverse-text-mix.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workspace", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--code", type=Path, default=REPO, help="the source tree whose orchestrator runs")
    parser.add_argument("--set", action="append", default=[], dest="sets")
    parser.add_argument("--report", type=Path, help="only report on this finished run folder")
    args = parser.parse_args()
    if args.report is not None:
        report(args.report, args.steps)
        return 0

    manifests = args.workspace / "manifests"
    shutil.copy(REPO / "manifests" / MANIFEST, manifests / MANIFEST)
    sets = ["orchestrator.rollouts_per_step=32", "orchestrator.eval_prompts=8", "orchestrator.eval_every=0",
            "orchestrator.max_off_policy_steps=1", f"orchestrator.max_steps={args.steps}",
            f"inference.port={free_port()}", *args.sets]
    runs = Path(tempfile.mkdtemp(prefix="env-split-"))
    env = {**os.environ, "PYTHONPATH": str(args.code), "PRIMEBUILD_STORE": str(args.workspace / "store")}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "primebuild.cli", "run", str(manifests / MANIFEST), "--runs-dir",
                           str(runs), "--quiet", *[a for s in sets for a in ("--set", s)]],
                          capture_output=True, text=True, env=env, cwd=args.code)  # `-m` puts the cwd first
    wall = time.monotonic() - started
    if done.returncode:
        print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
        return done.returncode
    (run_dir,) = [p for p in runs.iterdir() if p.is_dir()]
    print(f"code {args.code}, {args.steps} steps, {wall:.0f} s wall, sets {args.sets}")
    report(run_dir, args.steps)
    return 0


def report(run_dir: Path, steps: int) -> None:
    """Each batch's groups per environment (from the batch files), each environment's share of them, and the
    orchestrator's per-step generation time, stale drops and set-aside groups (from metrics.jsonl)."""
    from primebuild.contracts.run_dir import RunDir
    from primebuild.runtime.rollout_file import load_batch

    total: Counter[str] = Counter()
    print(f"run {run_dir}")
    for step in range(1, steps + 1):
        samples = load_batch(RunDir(run_dir).rollout(step)).samples
        groups = Counter(s.env_id for s in samples[::8])  # group_size 8: a group's samples are consecutive
        total += groups
        print(f"step {step:3d}: " + "  ".join(f"{e} {n}" for e, n in sorted(groups.items())))
    weights = {"reverse-text": 3, "long-tail": 1}
    for name, w in weights.items():
        print(f"{name}: {total[name]} of {sum(total.values())} trained groups = {total[name] / sum(total.values()):.3f}"
              f" (weight share {w / sum(weights.values()):.3f})")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    per_step = [r for r in rows if r["role"] == "orchestrator" and 1 <= r["step"] <= steps]
    for name in ("generation_seconds", "stale_groups_dropped", "filtered_groups"):
        values = [r["value"] for r in per_step if r["name"] == name]
        print(f"{name}: mean {sum(values) / len(values):.2f} per step, total {sum(values):.1f}")


if __name__ == "__main__":
    raise SystemExit(main())
