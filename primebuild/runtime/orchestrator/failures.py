"""Rollouts that fail: an environment that raises, a server that answers an error the client does not ride
out (a 4xx, an answer outside the rollout contract, a server failing for longer than the client waits).

One failed rollout costs its group, not the run: the group is dropped (its other episodes are cancelled:
they could only join a batch together), counted in the step's metrics (`failed_groups`) and logged once,
on one line with its cause, the traceback of each new cause going to the log file only. A broken
environment or server would fail every group, and a run that samples nothing is no run: after
`orchestrator.max_failed_groups_in_a_row` failed groups with no finished group in between, the run ends,
naming the last cause. Two errors are not one rollout's and still end the run at once: a user error (a
prompt that does not fit seq_len: the manifest's to fix) and no inference server answering for the
client's whole patience (the inference side is gone, not one request).
"""

from __future__ import annotations

import logging
import traceback

from primebuild.errors import UserError
from primebuild.runtime.orchestrator.client import InferenceUnavailable

log = logging.getLogger("primebuild.orchestrator")


class RolloutsFailing(RuntimeError):
    """Rollouts fail one after the other: the run cannot sample."""


def costs_the_run(err: BaseException) -> bool:
    """An error no other group would escape (see the module docstring), or a cancellation / exit."""
    return isinstance(err, UserError | InferenceUnavailable) or not isinstance(err, Exception)


def cause(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def origin(err: BaseException) -> tuple[str, str, int]:
    """Where the root of `err` was raised (the innermost frame of the first exception in its chain): one
    cause, whatever its message says (a malformed row names its row)."""
    seen = set()
    while id(err) not in seen and (err.__cause__ or err.__context__) is not None:
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return type(err).__name__, tb.tb_frame.f_code.co_filename if tb else "", tb.tb_lineno if tb else 0


class GroupFailures:
    def __init__(self, limit: int):
        self.limit = limit
        self.in_a_row = 0
        self.traced: set[tuple[str, str, int]] = set()

    def failed(self, what: str, err: Exception) -> None:
        """Group `what` failed with `err`: log it; raise RolloutsFailing when that makes `limit` in a row."""
        self.in_a_row += 1
        log.warning("rollout group %s failed and is dropped (%d in a row; %d end the run): %s",
                    what, self.in_a_row, self.limit, cause(err))
        if origin(err) not in self.traced:  # indented: the terminal shows the line above, the log keeps this
            self.traced.add(origin(err))
            trace = "".join(traceback.format_exception(err)).rstrip()
            log.info("the traceback of that failure (once per place an error comes from):\n%s",
                     "\n".join(f"    | {line}" for line in trace.splitlines()))
        if self.in_a_row >= self.limit:
            raise RolloutsFailing(f"{self.in_a_row} rollout groups failed in a row "
                                  f"(orchestrator.max_failed_groups_in_a_row: {self.limit}); the last, {what}: "
                                  f"{cause(err)}")

    def finished(self) -> None:
        self.in_a_row = 0
