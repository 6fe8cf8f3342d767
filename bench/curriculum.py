"""The curriculum on vs off: the same run, the same steps and seed, with and without orchestrator.curriculum.

    .venv/bin/python bench/curriculum.py --steps 100
    .venv/bin/python bench/curriculum.py --steps 40 --manifests wordle.yaml tool-use.yaml --prompts 128

For each manifest (default: wordle.yaml), runs `primebuild run` once with the curriculum off and once on
(`--prompts` prompts per environment, `--window`, the default thresholds and mix unless given), one after
the other, and prints side by side: held-out reward before and after (the orchestrator's greedy eval), the
gain, trained samples (steps x rollouts_per_step: the same for both), rollout groups sampled (trained,
set aside by the difficulty filter, dropped as stale), the gain per trained sample and per wall second,
and, with the curriculum on, the pools' sizes at the last step and the groups each pool gave over the run.
Wall seconds on a shared machine are only as comparable as the load was: say what else ran.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

REPO = Path(__file__).resolve().parents[1]
POOLS = ("easy", "normal", "hard")


def free_port() -> int:
    """A port nobody listens on now (other runs may share this machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(manifest: str, steps: int, runs: Path, sets: list[str], env: dict) -> dict:
    out = runs / f"{Path(manifest).stem}-{len(list(runs.iterdir()))}"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "primebuild.cli", "run", str(REPO / "manifests" / manifest),
                           "--runs-dir", str(out), "--quiet", "--set", f"orchestrator.max_steps={steps}",
                           "--set", f"inference.port={free_port()}",
                           *sum((["--set", s] for s in sets), [])], capture_output=True, text=True, env=env)
    wall = time.monotonic() - started
    if done.returncode:
        raise SystemExit(f"{manifest} {sets}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    (run_dir,) = list(out.iterdir())
    summary = json.loads((run_dir / "summary.json").read_text())
    steps_rows: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line) if line else None
        if row and row["role"] == "orchestrator" and row["step"] > 0:
            steps_rows.setdefault(row["step"], {})[row["name"]] = row["value"]
    trained = [r for r in steps_rows.values() if "reward_mean" in r]
    per_step = json.loads((run_dir / "plan.json").read_text())
    (orch,) = [p for p in per_step["processes"] if p["role"] == "orchestrator"]
    samples = len(trained) * orch["config"]["rollouts_per_step"]
    groups = len(trained) * orch["config"]["rollouts_per_step"] // orch["config"]["group_size"]
    last = trained[-1] if trained else {}
    return {
        "before": summary["eval_reward_before"], "after": summary["eval_reward_after"],
        "gain": summary["eval_reward_gain"], "wall_s": wall, "samples": samples,
        "groups_sampled": groups + int(sum(r.get("filtered_groups", 0) + r.get("stale_groups_dropped", 0)
                                           for r in trained)),
        "reward_first": trained[0]["reward_mean"] if trained else None, "reward_last": last.get("reward_mean"),
        "pools_last": {p: int(last[f"curriculum_{p}"]) for p in POOLS if f"curriculum_{p}" in last},
        # the largest each pool was at a cut: an easy or hard prompt is drawn soon after it qualifies
        "pools_max": {p: int(max(r[f"curriculum_{p}"] for r in trained)) for p in POOLS if f"curriculum_{p}" in last},
        "sampled": {p: int(sum(r.get(f"curriculum_sampled_{p}", 0) for r in trained)) for p in POOLS},
        "borrowed": int(sum(r.get("curriculum_borrowed", 0) for r in trained)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--manifests", nargs="+", default=["wordle.yaml"])
    parser.add_argument("--prompts", type=int, default=128, help="orchestrator.curriculum.prompts")
    parser.add_argument("--window", type=int, default=2, help="orchestrator.curriculum.window")
    parser.add_argument("--curriculum", default="", help="more curriculum fields, e.g. 'easy_at: 0.9, mix: {...}'")
    parser.add_argument("--arms", nargs="+", choices=["off", "on"], default=["off", "on"],
                        help="which runs (e.g. only `on` again with other thresholds)")
    parser.add_argument("--seed", type=int, default=None, help="the manifest's seed (default: as written)")
    parser.add_argument("--store", default=None, help="PRIMEBUILD_STORE (default: the usual one)")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"PRIMEBUILD_STORE": args.store} if args.store else {})}
    extra = f", {args.curriculum}" if args.curriculum else ""
    on = f"orchestrator.curriculum={{prompts: {args.prompts}, window: {args.window}{extra}}}"
    seed = [f"seed={args.seed}"] if args.seed is not None else []
    results = []
    with TemporaryDirectory() as tmp:
        for manifest in args.manifests:
            for name, sets in (("off", []), ("on", [on])):
                if name not in args.arms:
                    continue
                r = run(manifest, args.steps, Path(tmp), seed + sets, env)
                results.append((manifest, name, r))
                print(f"{manifest} curriculum {name}: {json.dumps(r)}", flush=True)
    print(f"\n{on}, {args.steps} steps{f', seed {args.seed}' if seed else ''}")
    print("| manifest | curriculum | held-out before -> after | gain | trained samples | groups sampled | "
          "gain / 1k samples | gain / 1k wall s | wall s | pools at the end (largest) (easy/normal/hard) | "
          "groups drawn per pool (borrowed) |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---|---|")
    for manifest, name, r in results:
        pools = (f"{'/'.join(str(r['pools_last'][p]) for p in POOLS)} "
                 f"({'/'.join(str(r['pools_max'][p]) for p in POOLS)})") if r["pools_last"] else "-"
        drawn = "/".join(str(r["sampled"][p]) for p in POOLS) + f" ({r['borrowed']})" if r["pools_last"] else "-"
        print(f"| {manifest} | {name} | {r['before']:.4f} -> {r['after']:.4f} | {r['gain']:+.4f} | {r['samples']:,} | "
              f"{r['groups_sampled']:,} | {1000 * r['gain'] / r['samples']:+.4f} | {1000 * r['gain'] / r['wall_s']:+.3f} "
              f"| {r['wall_s']:.0f} | {pools} | {drawn} |")


if __name__ == "__main__":
    main()
