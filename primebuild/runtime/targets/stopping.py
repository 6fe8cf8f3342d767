"""Stopping a run gracefully: the one sequence `primebuild stop` and a follower's Ctrl-C (slurm, kubernetes) share.

1. write RUN_DIR/STOP: the trainer checkpoints after its current step and the orchestrator stops, so the run
   ends by itself and `primebuild run --resume` continues it;
2. wait up to the grace for the target to run nothing of it any more;
3. end what is left with the target's `stop` (scancel, deleting the objects, killing process groups), then
   wait for the supervisor's own end (it ends the workers and records the outcome); a run that ended by
   itself is `release`d instead (a finished JobSet's pods: their logs copied, the objects deleted).

A target that does not answer (slurmctld busy or restarting, an API server timing out) raises
`TargetUnanswered`: the run's state is unknown, so it counts as still running and the wait goes on, saying so,
instead of ending the stop with an error while the run goes on by itself.
"""

from __future__ import annotations

import time

from primebuild.contracts.run_dir import LaunchRecord, RunDir
from primebuild.runtime.targets.base import Echo, Target, TargetUnanswered

POLL_SECONDS = 0.5
UNANSWERED_NOTICE_SECONDS = 60.0  # how often a wait says again that the target does not answer


def own_end_seconds() -> float:
    """How long a run's own supervisor may take to end it after STOP: the trainer's grace, then SIGTERM and
    SIGKILL. A stop that signals sooner records a kill instead of the stop that was asked for."""
    from primebuild.runtime.supervisor import GRACE_SECONDS, TERM_SECONDS

    return GRACE_SECONDS + TERM_SECONDS + 5


def stop_gracefully(target: Target, run: RunDir, record: LaunchRecord, *, grace: float, echo: Echo,
                    interruptible: bool = False) -> None:
    """STOP, up to `grace` seconds for the run to end by itself, then the target's stop. `interruptible`: a
    Ctrl-C during the grace (the second one of a follower) skips to the target's stop."""
    from primebuild.runtime.supervisor import GRACE_SECONDS, TERM_SECONDS

    run.stop_file.touch()
    if grace >= GRACE_SECONDS:  # the supervisor's own end fits in a grace this long: let it finish
        grace = max(grace, own_end_seconds())
    waiting = _Waiting(target, run, record, echo)
    try:
        waiting.until(time.monotonic() + grace)
    except KeyboardInterrupt:
        if not interruptible:
            raise
    if waiting.maybe_active():
        echo(target.stop(run, record))
        waiting.until(time.monotonic() + TERM_SECONDS + 5)
    elif (released := target.release(run, record)) is not None:
        echo(released)


class _Waiting:
    """Polls whether anything of the run still runs; an unanswered query counts as "yes", said once a minute."""

    def __init__(self, target: Target, run: RunDir, record: LaunchRecord, echo: Echo):
        self.target, self.run, self.record, self.echo = target, run, record, echo
        self.unanswered_since: float | None = None
        self.told = float("-inf")

    def maybe_active(self) -> bool:
        try:
            active = self.target.active(self.run, self.record)
        except TargetUnanswered as err:
            now = time.monotonic()
            self.unanswered_since = self.unanswered_since or now
            if now - self.told >= UNANSWERED_NOTICE_SECONDS:
                self.echo(f"warning: {err.problems[0].message}; asking again (the run's state unknown for "
                          f"{now - self.unanswered_since:.0f} s)")
                self.told = now
            return True
        self.unanswered_since = None
        return active

    def until(self, deadline: float) -> None:
        while time.monotonic() < deadline and self.maybe_active():
            time.sleep(POLL_SECONDS)
