"""Before a stopped or crashed run continues: make its folder agree with the checkpoint it resumes from.

A run may have been killed at any instant (`kill -9` of `primebuild run`, a lost host, a power cut), so
first whatever was half done in the folder is finished: a weight or checkpoint folder being written,
renamed or deleted (primebuild/runtime/weight_sync/filesystem.py), a rollout batch or a JSON record
being written, a metrics line being appended. None of those is an error; each is named.

The trainer resumes after the newest checkpoint that verifies (filesystem.py names and skips damaged
ones). It writes a step's metrics row right after the step's checkpoint; a kill between the two leaves
a checkpoint whose step has no row, and resuming after it would leave that step out of metrics.jsonl for
good. When the checkpoint of the step before verifies too, the run resumes from that one instead, so
the step is trained again and recorded once; with checkpoints further apart that would retrain a whole
interval for one row, so the checkpoint is kept and the missing row named.

Weight folders published *after* the checkpoint resumed from were trained in the previous session from a
state that is now gone: left in place, the orchestrator would serve them as current — and the final
evaluation would score the previous session's weights, not this one's. They are removed here, before
any process starts; the trainer publishes those steps again as it retrains them. Rollout batches stay:
the trainer retrains exactly those, so the step sequence stays continuous.

A trainer-only restart (the supervisor restarts the trainer group while the servers and the orchestrator
run on: `trainer_restart`) finishes only what the trainer itself writes, its checkpoints, and applies the
same one-row rule. Its weight folders stay: the orchestrator may be serving them, and the trainer, from the
same checkpoint and the same rollout batches, publishes the same bytes again (filesystem.commit keeps an
identical folder in place, so a server never finds it gone).
"""

from __future__ import annotations

from collections.abc import Callable

from primebuild.contracts.run_dir import RunDir
from primebuild.runtime.metrics import cut_torn_tail, read_metrics
from primebuild.runtime.rollout_file import unfinished_writes
from primebuild.runtime.weight_sync import filesystem as fs


def reconcile(run: RunDir, echo: Callable[[str], None] = print) -> int:
    """Return the step the run continues after (0: from the start); drop weight folders newer than it.
    Only while no process of the run is running (`run --resume` checks that first)."""
    for line in finish_interrupted(run):
        echo(f"resume: {line}")
    latest = fs.latest_verified(run.checkpoints, warn=lambda text: echo(f"resume: {text}"))
    resume_after = step_with_its_row(run, latest[0], echo) if latest else 0
    stale = [s for s in fs.step_folders(run.weights) if s > resume_after]
    if stale:
        echo(f"resume: dropping weights of steps {stale[0]}..{stale[-1]}, newer than the checkpoint of step "
             f"{resume_after}; the trainer publishes them again")
        fs.remove_steps(run.weights, stale)
    return resume_after


def trainer_restart(run: RunDir, echo: Callable[[str], None] = print) -> int:
    """Before the supervisor starts a failed trainer group again: finish a checkpoint write it was killed in,
    and return the step it resumes after (what its own `resume` will pick: the newest verified checkpoint,
    or the one before when that step has no metrics row). Only while no trainer process runs."""
    for line in fs.finish_interrupted(run.checkpoints):
        echo(f"trainer restart: {line}")
    latest = fs.latest_verified(run.checkpoints, warn=lambda text: echo(f"trainer restart: {text}"))
    return step_with_its_row(run, latest[0], echo) if latest else 0


def finish_interrupted(run: RunDir) -> list[str]:
    """Complete what processes killed mid-operation left in the run folder; one line per thing done."""
    done = fs.finish_interrupted(run.checkpoints) + fs.finish_interrupted(run.weights)
    for leftover in unfinished_writes(run.rollouts) + run.unfinished_json_writes():
        leftover.unlink(missing_ok=True)
        done.append(f"deleted {leftover.relative_to(run.root)} (an unfinished write)")
    torn = cut_torn_tail(run.metrics)
    if torn:
        done.append(f"cut {torn} bytes off the end of {run.metrics.name} (a line whose writer was killed)")
    return done


def step_with_its_row(run: RunDir, step: int, echo: Callable[[str], None]) -> int:
    """`step`, the newest verified checkpoint, or the step before it when `step` has no metrics row (see
    the module docstring)."""
    if not run.metrics.is_file() or step in read_metrics(run.metrics, role="trainer"):
        return step
    if step > 1:  # step 1 is trained again from the start model
        try:
            fs.verify(fs.step_folder(run.checkpoints, step - 1))
        except fs.DamagedFolder:
            echo(f"resume: step {step} has a checkpoint but no metrics row (stopped between the two); its row "
                 "stays missing: no checkpoint of the step before to train it again from")
            return step
    echo(f"resume: step {step} has a checkpoint but no metrics row (stopped between the two): resuming "
         f"after step {step - 1}, so step {step} is trained and recorded again")
    fs.discard(fs.step_folder(run.checkpoints, step))
    return step - 1
