"""Async vs synchronous RL on the same manifest and step count, beside what the plan predicts for it.

    .venv/bin/python bench/async_rl.py                                   # long-tail multi-turn (default)
    .venv/bin/python bench/async_rl.py --manifest manifests/reverse-text.yaml --steps 60 --off 2

Runs `primebuild run MANIFEST` twice: once with `max_off_policy_steps: 0` (synchronous: a step's
rollouts all start on the weights it trains, the trainer waits for the slowest, then inference waits for
the trainer) and once with `--off` (the continuous rollout pool: docs/async.md). The async run is longer
(`--async-steps`, default 5x): its first steps come from the initial burst of rollouts in flight, whose
short ones finish first, so a run as short as the synchronous one measures that transient, not the steady
state. Prints per mode the RL loop's seconds per step (= per trained sample, both modes train the same
number of samples per step), the trainer's idle fraction (waiting for a batch), the inference side's (no
rollout running; no request in flight), stale groups dropped, and what the batches hold (model turns per
sample, trained tokens per step: async batches favour short episodes); then the ratios of samples and of
trained tokens per second, the ratio over the first `--steps` steps of each (the same samples), and, when
the manifest declares `orchestrator.rollout_profile`, the plan's predicted steps, idle fractions and ratio
for the same manifest (`primebuild plan -o json`). Evaluation is shrunk to a few prompts; the SFT model
comes from the store (built once).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from tempfile import TemporaryDirectory

from primebuild.contracts.estimates import ProfileTimes
from primebuild.contracts.plan import Plan

REPO = Path(__file__).resolve().parents[1]


def primebuild(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "primebuild.cli", *args], check=True, capture_output=True, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def run(manifest: Path, off: int, steps: int, runs: Path, port: int) -> dict:
    out = runs / f"off{off}"
    primebuild("run", str(manifest), "--runs-dir", str(out), "--quiet", "--set", f"orchestrator.max_steps={steps}",
               "--set", f"orchestrator.max_off_policy_steps={off}", "--set", "orchestrator.eval_prompts=8",
               "--set", "orchestrator.eval_every=0", "--set", f"inference.port={port}")
    (run_dir,) = list(out.iterdir())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]

    def values(role: str, name: str) -> list[float]:
        return [r["value"] for r in rows if r["role"] == role and r["name"] == name and r["step"] >= 1]

    wait, busy = sum(values("trainer", "wait_s")), sum(values("trainer", "step_s")) + sum(values("trainer", "publish_s"))
    loop = wait + busy  # the trainer's loop: from waiting for batch 1 to publishing the last step
    per_step = [a + b + c for a, b, c in zip(values("trainer", "wait_s"), values("trainer", "step_s"),
                                            values("trainer", "publish_s"), strict=True)]
    # the orchestrator's intervals start at its first batch; the first interval also holds start-up
    intervals = values("orchestrator", "generation_seconds")[1:]
    return {
        "off": off, "steps": steps, "rl_loop_seconds": loop, "step_seconds": loop / steps,
        "trainer_idle_fraction": wait / loop if loop else 0.0,
        "rollout_idle_fraction": sum(values("orchestrator", "rollout_idle_seconds")[1:]) / sum(intervals),
        "request_idle_fraction": sum(values("orchestrator", "inference_idle_seconds")[1:]) / sum(intervals),
        "train_seconds_per_step": statistics.median(values("trainer", "step_s")),
        "publish_seconds_per_step": statistics.median(values("trainer", "publish_s")),
        "interval_seconds_median": statistics.median(intervals),
        "rollout_seconds_mean": statistics.mean(values("orchestrator", "rollout_seconds_mean")),
        "rollout_seconds_max_median": statistics.median(values("orchestrator", "rollout_seconds_max")),
        "turns_mean": statistics.mean(values("orchestrator", "turns_mean")),
        "trained_tokens_per_step": statistics.mean(values("trainer", "tokens")),
        "loop_seconds_by_step": per_step,
        "stale_groups_dropped": sum(values("orchestrator", "stale_groups_dropped")),
        "wall_seconds": json.loads((run_dir / "summary.json").read_text())["wall_seconds"],
    }


def predicted(manifest: Path, off: int) -> ProfileTimes | None:
    plan = Plan.model_validate_json(primebuild("plan", str(manifest), "-o", "json", "--set",
                                               f"orchestrator.max_off_policy_steps={off}").stdout)
    return plan.estimates.profile


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--manifest", type=Path, default=REPO / "manifests" / "long-tail.yaml")
    parser.add_argument("--steps", type=int, default=30, help="synchronous steps")
    parser.add_argument("--async-steps", type=int, help="asynchronous steps (default: 5x --steps)")
    parser.add_argument("--off", type=int, help="max_off_policy_steps of the async run (default: the manifest's)")
    parser.add_argument("--port", type=int, default=8710)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--keep", type=Path, help="keep the two run folders under this folder")
    args = parser.parse_args()
    if args.off is None:
        plan = json.loads(primebuild("plan", str(args.manifest), "-o", "json").stdout)
        config = next(p["config"] for p in plan["processes"] if p["role"] == "orchestrator")
        args.off = max(1, config["max_off_policy_steps"])
    load = os.getloadavg()[0]
    with TemporaryDirectory() as tmp:
        runs = args.keep or Path(tmp)
        sync = run(args.manifest, 0, args.steps, runs, args.port)
        asyn = run(args.manifest, args.off, args.async_steps or 5 * args.steps, runs, args.port + 1)
    expected = predicted(args.manifest, args.off)
    print(f"{args.manifest.name}: {sync['steps']} synchronous and {asyn['steps']} asynchronous steps; load average "
          f"{load:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(f"{'mode':<16}{'step s':>8}{'loop s':>8}{'trainer idle':>14}{'no rollout':>12}{'no request':>12}"
          f"{'train s':>9}{'rollout s':>11}{'slowest s':>11}{'dropped':>9}{'turns':>7}{'tokens':>8}")
    for name, r in (("sync (off 0)", sync), (f"async (off {args.off})", asyn)):
        print(f"{name:<16}{r['step_seconds']:>8.2f}{r['rl_loop_seconds']:>8.1f}{r['trainer_idle_fraction']:>14.0%}"
              f"{r['rollout_idle_fraction']:>12.0%}{r['request_idle_fraction']:>12.0%}"
              f"{r['train_seconds_per_step']:>9.2f}{r['rollout_seconds_mean']:>11.2f}"
              f"{r['rollout_seconds_max_median']:>11.2f}{r['stale_groups_dropped']:>9.0f}{r['turns_mean']:>7.2f}"
              f"{r['trained_tokens_per_step']:>8.0f}")
    ratio = sync["step_seconds"] / asyn["step_seconds"]
    tokens_ratio = ratio * asyn["trained_tokens_per_step"] / sync["trained_tokens_per_step"]
    same = sum(asyn["loop_seconds_by_step"][:sync["steps"]])
    print(f"measured: async/sync speed-up {ratio:.2f}x in samples per second, {tokens_ratio:.2f}x in trained tokens "
          f"per second; over the same {sync['steps']} steps (the same samples) {sync['rl_loop_seconds'] / same:.2f}x")
    if expected:
        print(f"{'plan (predicted)':<16}{'sync step s':>12}{'async step s':>13}{'trainer idle':>20}{'inference idle':>22}"
              f"{'train s':>9}{'rollout s':>11}{'slowest s':>11}")
        print(f"{'':<16}{expected.sync_step_seconds:>12.2f}{expected.async_step_seconds:>13.2f}"
              f"{expected.sync_trainer_idle:>10.0%} / {expected.async_trainer_idle:<7.0%}"
              f"{expected.sync_inference_idle:>12.0%} / {expected.async_inference_idle:<7.0%}"
              f"{expected.train_seconds:>9.2f}{expected.expected_rollout_seconds:>11.2f}"
              f"{expected.tail_rollout_seconds:>11.2f}")
        error = expected.async_sync_ratio / ratio - 1
        print(f"predicted: {expected.async_sync_ratio:.2f}x ({error:+.0%} vs measured); sync step "
              f"{expected.sync_step_seconds:.2f} s vs {sync['step_seconds']:.2f} s, async step "
              f"{expected.async_step_seconds:.2f} s vs {asyn['step_seconds']:.2f} s")
    if args.json:
        args.json.write_text(json.dumps({"sync": sync, "async": asyn, "plan": expected.model_dump() if expected else None,
                                         "ratio": ratio,
                                         "tokens_ratio": tokens_ratio, "load_before": load}, indent=2))


if __name__ == "__main__":
    main()
