"""Before a stopped or crashed run continues: make its folder agree with the checkpoint it resumes from.

The trainer resumes after the newest checkpoint that verifies (primebuild/runtime/weight_sync/filesystem.py names
and skips damaged ones). Weight folders published *after* that checkpoint were trained in the previous
session from a state that is now gone: left in place, the orchestrator would serve them as current —
and the final evaluation would score the previous session's weights, not this one's. They are removed
here, before any process starts; the trainer publishes those steps again as it retrains them. Rollout
batches stay: the trainer retrains exactly those, so the step sequence stays continuous.
"""

from __future__ import annotations

from collections.abc import Callable

from primebuild.contracts.run_dir import RunDir
from primebuild.runtime.weight_sync import filesystem as fs


def reconcile(run: RunDir, echo: Callable[[str], None] = print) -> int:
    """Return the step the run continues after (0: from the start); drop weight folders newer than it."""
    latest = fs.latest_verified(run.checkpoints, warn=lambda text: echo(f"resume: {text}"))
    resume_after = latest[0] if latest else 0
    stale = [s for s in fs.step_folders(run.weights) if s > resume_after]
    if stale:
        echo(f"resume: dropping weights of steps {stale[0]}..{stale[-1]}, newer than the checkpoint of step "
             f"{resume_after}; the trainer publishes them again")
        fs.remove_steps(run.weights, stale)
    return resume_after
