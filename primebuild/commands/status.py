"""`primebuild status RUN_DIR`: where a run stands, from its folder alone (no process is asked)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from primebuild.commands.options import output_option, run_dir_argument, runs_dir_option
from primebuild.contracts.plan import read_plan
from primebuild.contracts.run_dir import find_run
from primebuild.contracts.run_summary import OrchestratorSummary, RunSummary


@click.command("status")
@run_dir_argument
@runs_dir_option
@output_option
def command(run_dir: Path | None, runs_dir: Path, output: str) -> None:
    """Steps sampled and trained, latest policy, rewards and the outcome of RUN_DIR (default: the newest run)."""
    from primebuild.runtime.metrics import read_rows
    from primebuild.runtime.report import series

    run = find_run(run_dir, runs_dir)
    plan = read_plan(run.plan)
    rows = read_rows(run.metrics)
    trained, _ = series(rows, "trainer", "loss")
    sampled, rewards = series(rows, "orchestrator", "reward_mean")
    summary = RunSummary.read(run.summary)  # written when a session ends (a resumed run: the last one's)
    live = OrchestratorSummary.read(run.orchestrator_state)  # the orchestrator's, while it runs
    ended = run.read_outcome()  # this session's end; none while it runs
    failure = run.read_json(run.failure)
    orchestrator = plan.by_role("orchestrator")
    state = {
        "run_dir": str(run.root), "name": plan.name, "plan_hash": plan.plan_hash,
        "max_steps": orchestrator[0].config.max_steps if orchestrator else None,
        "steps_sampled": max(sampled, default=0), "steps_trained": max(trained, default=0),
        "last_reward": rewards[-1] if rewards else None,
        # STOP is also how the supervisor ends the others after a failure: that is no request of the user's
        "stop_requested": run.stop_requested() and not failure and ended is None,
        "outcome": ended.message if ended else _no_outcome(run, plan),
        "eval_reward_before": _first(live.eval_reward_before, summary.eval_reward_before),
        "eval_reward_after": _first(live.eval_reward_after, summary.eval_reward_after),
        "target": _target_state(run, plan),
    }
    if failure:
        state["failed_process"] = failure.get("process")
        state["failure"] = failure.get("message")
    if output == "json":
        click.echo(json.dumps(state, indent=2, sort_keys=True))
        return
    for key, value in state.items():
        click.echo(f"{key:>20}: {value}")


def _no_outcome(run, plan) -> str | None:
    """None while the session runs; for one that ended without recording how (its supervisor was killed, or
    could not write), say so rather than nothing for ever."""
    from primebuild.errors import UserError
    from primebuild.runtime.targets import target_for

    record = run.read_launch()
    try:
        if record is None or target_for(record.target).active(run, record):
            return None
    except UserError:  # the target cannot tell now (an ssh host that does not answer): no guess
        return None
    return (f"ended without recording an outcome (nothing followed it to its end: it was detached, or its "
            f"supervisor was killed or could not write in {run.root}); `primebuild stop {run.root}` collects what "
            f"the cluster keeps of it, `primebuild run --resume {run.root}` continues after the newest checkpoint")


def _first(*values):
    return next((v for v in values if v is not None), None)


def _target_state(run, plan) -> str:
    """One line from the target itself (a Slurm job's state, live processes), never a guess."""
    from primebuild.errors import UserError
    from primebuild.runtime.targets import target_for

    record = run.read_launch()
    if record is None:
        return f"{plan.target.kind}: starting" if run.claimed() else f"{plan.target.kind}: never launched"
    try:
        return target_for(record.target).state(run, record)
    except UserError as err:  # e.g. an ssh host that does not answer now: the folder still says the rest
        return f"{record.target}: unknown ({err.problems[0].message})"
