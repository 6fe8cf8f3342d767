"""The end of a distributed trainer, in one fixed order, so that a finished run exits 0.

A finished 2-rank CP run once failed at exit: rank 1 aborted with "terminate called without an active
exception" (a C++ thread object destroyed while its thread still ran) and torchrun failed the group.
`dist.destroy_process_group()` shuts every group down and forgets it, but does not end its threads: a gloo
group's worker threads (pt_gloo_runloop) and its TCP loop (gloo_tcp_loop) are joined by the group's
destructor only. Every DeviceMesh keeps its groups in its root's `_pg_registry`, and DTensor's sharding
caches keep the meshes alive to the end of the interpreter, so the groups were destroyed, their threads
joined or not, while Python was being finalized. Measured on the 2-rank CP and EP trainers of
tests/test_trainer_teardown.py: 12 gloo threads alive per rank after destroy_process_group, 0 once the
registries are emptied and the garbage collected.

The order, on every rank:
  1. barrier (a run that finished only): every rank is past its last collective, none is in flight;
  2. destroy_process_group(): every group shut down (c10d goes newest first, the default group last) and
     unregistered;
  3. the meshes let their groups go, the collector runs: each group is destroyed now and joins its
     threads, while the interpreter is whole.
The trained module must be gone by then: FSDP's state holds its groups too (`run_trainer` trains in a
function of its own for that reason).
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger("primebuild.trainer")


class ProcessGroups:
    """The device meshes this process built, and their end."""

    def __init__(self) -> None:
        self._roots: list[DeviceMesh] = []

    def track(self, mesh: DeviceMesh | None) -> None:
        """Remember a mesh; its root holds the groups of every mesh sliced, flattened or unflattened from it."""
        if mesh is None:
            return
        root = mesh._root_mesh or mesh
        if all(root is not known for known in self._roots):
            self._roots.append(root)

    def close(self, finished: bool, default_group: bool) -> None:
        """Steps 1–3 above; steps 1–2 only where this process made the default group (`default_group`),
        and step 1 only after a finished run: after a failure a peer may be gone, and the barrier would
        wait out the group's timeout."""
        if not default_group:  # one process: it made no group and built no mesh
            return
        if dist.is_initialized():
            if finished:
                dist.barrier()
            dist.destroy_process_group()
        for root in self._roots:
            root._pg_registry.clear()
        self._roots.clear()
        gc.collect()  # modules and their FSDP state sit in reference cycles: free the groups they hold now
        if left := gloo_threads():
            log.warning("teardown: %d gloo threads still run (a process group is still referenced); the "
                        "interpreter will end them at exit", left)


def gloo_threads() -> int:
    """This process's native gloo threads (pt_gloo_runloop, gloo_tcp_loop), read from /proc (0 elsewhere)."""
    count = 0
    for comm in Path("/proc/self/task").glob("*/comm"):
        try:
            count += "gloo" in comm.read_text()
        except OSError:  # the thread ended meanwhile
            pass
    return count
