"""`primebuild status RUN_DIR`: where a run stands, from its folder alone (no process is asked)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from primebuild.errors import UserError


@click.command("status")
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("-o", "--output", type=click.Choice(["text", "json"]), default="text", show_default=True)
def command(run_dir: Path, output: str) -> None:
    """Steps sampled and trained, latest policy, rewards and the outcome of RUN_DIR."""
    from primebuild.runtime.report import read_metrics, series

    if not (run_dir / "plan.json").is_file():
        raise UserError(f"{run_dir} is not a run folder (no plan.json)")
    plan = json.loads((run_dir / "plan.json").read_text())
    rows = read_metrics(run_dir / "metrics.jsonl")
    trained, _ = series(rows, "trainer", "loss")
    sampled, rewards = series(rows, "orchestrator", "reward_mean")
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    state = {
        "run_dir": str(run_dir), "name": plan["name"], "plan_hash": plan["plan_hash"],
        "max_steps": next((p["config"].get("max_steps") for p in plan["processes"] if p["role"] == "orchestrator"),
                          None),
        "steps_sampled": max(sampled, default=0), "steps_trained": max(trained, default=0),
        "last_reward": rewards[-1] if rewards else None, "stop_requested": (run_dir / "STOP").exists(),
        "outcome": summary.get("outcome"), "eval_reward_before": summary.get("eval_reward_before"),
        "eval_reward_after": summary.get("eval_reward_after"),
    }
    if output == "json":
        click.echo(json.dumps(state, indent=2, sort_keys=True))
        return
    for key, value in state.items():
        click.echo(f"{key:>20}: {value}")
