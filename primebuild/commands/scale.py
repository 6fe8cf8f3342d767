"""`primebuild scale [RUN_DIR] --inference +1|-1`: add or retire an inference replica of a running run.

The running supervisor does it (primebuild/runtime/elastic.py): this command writes a request into the run folder,
waits for the supervisor's answer and prints it. Exit 0 when done, 2 when refused (a target, engine or
split where scaling is not built, no run going on, the last replica). Either weight sync: under broadcast
the new replica joins the trainer's weight group (primebuild/runtime/weight_sync/membership.py).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from pathlib import Path

import click

from primebuild.commands.options import output_option, run_dir_argument, runs_dir_option
from primebuild.contracts.plan import read_plan
from primebuild.contracts.run_dir import ScaleAnswer, ScaleRequest, find_run, write_json_atomic
from primebuild.errors import UserError

POLL_SECONDS = 0.2
WAITING_EVERY_S = 15.0  # how often a wait says it still waits, and checks that the run still runs


def _finite(value: float) -> float:
    if not math.isfinite(value):  # FloatRange lets nan through
        raise click.BadParameter("must be a number of seconds", param_hint="--timeout")
    return value


@click.command("scale")
@run_dir_argument
@runs_dir_option
@click.option("--inference", "delta", type=click.Choice(["+1", "-1"]), required=True,
              help="+1 adds an inference replica (it joins at the current weights); -1 drains and retires one.")
@click.option("--timeout", type=click.FloatRange(min=1, max=3600), default=600.0, show_default=True,
              callback=lambda ctx, param, value: _finite(value),
              help="Seconds to wait for the supervisor's answer (a new replica's start, a drain).")
@output_option
def command(run_dir: Path | None, runs_dir: Path, delta: str, timeout: float, output: str) -> None:
    """Add (+1) or retire (-1) an inference replica of RUN_DIR (default: the newest run) without stopping it."""
    from primebuild.runtime.elastic import scale_refusal
    from primebuild.runtime.targets import target_for

    run = find_run(run_dir, runs_dir)
    record = run.read_launch()
    if record is None:
        raise UserError(f"{run.root} was never launched: nothing to scale")
    refusal = scale_refusal(read_plan(run.plan), record.target)
    if refusal:
        raise UserError(refusal)
    if not target_for(record.target).active(run, record) or run.read_outcome() is not None:
        raise UserError(f"{run.root} is not running: nothing to scale",
                        hint=f"`primebuild run --resume {run.root}` continues it")
    request = ScaleRequest(id=uuid.uuid4().hex[:12], inference=int(delta))
    write_json_atomic(run.scale_request(request.id), request.model_dump(mode="json"))
    target = target_for(record.target)
    started = time.monotonic()
    said = started
    if output != "json":
        click.echo(f"asked the run's supervisor to {'add' if delta == '+1' else 'retire'} an inference replica; "
                   f"waiting for its answer (at most {timeout:.0f} s)")
    while not run.scale_answer(request.id).is_file():
        now = time.monotonic()
        if now - started > timeout:
            raise UserError(f"no answer from the run's supervisor within {timeout:.0f} s",
                            hint=f"see {run.logs}/ and `primebuild status {run.root}`")
        if now - said >= WAITING_EVERY_S:
            said = now
            if not target.active(run, record):
                raise UserError(f"{run.root} stopped running before its supervisor answered",
                                hint=f"`primebuild status {run.root}` says how it ended")
            if output != "json":
                click.echo(f"still waiting ({now - started:.0f} s; a new replica loads the model first)")
        time.sleep(POLL_SECONDS)
    answer = ScaleAnswer.model_validate_json(run.scale_answer(request.id).read_text())
    if output == "json":
        click.echo(json.dumps(answer.model_dump(mode="json"), indent=2, sort_keys=True))
    if not answer.ok:
        raise UserError(answer.message)
    if output != "json":
        click.echo(answer.message)
