"""The plan's host memory for a vLLM server on a CPU (builders/vllm_cpu_memory.py) against a real one.

A vLLM server on a CPU is three processes (API server, engine core, worker with its fixed-size KV cache):
~2.9 GiB where the plan once counted one 512 MiB process. The session's shared vllm-cpu server is measured
after it has served requests: the sum of its processes' proportional set sizes (shared pages split between
the processes that map them) must be within what the plan counts for a tp=1, dp=1 server of that model,
and the plan must not count more than 1.6x of it (an estimate that large would refuse runs that fit).
"""

from __future__ import annotations

import psutil
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MIB = 1 << 20


def _tree_pss(pid: int) -> dict[str, int]:
    root = psutil.Process(pid)
    return {f"{p.name()} [{p.pid}]": p.memory_full_info().pss for p in [root, *root.children(recursive=True)]}


def test_the_plan_counts_every_process_of_a_vllm_server_on_a_cpu(vllm_tiny):
    from primebuild.builders.vllm_cpu_memory import vllm_cpu_server

    for _ in range(3):  # the worker's buffers grow with its first batches
        vllm_tiny.complete({"model": vllm_tiny.model_name, "prompt": [5, 6, 7, 8], "max_tokens": 16,
                            "temperature": 1.0, "n": 8})
    measured = _tree_pss(vllm_tiny.proc.pid)
    total = sum(measured.values())
    assert len([n for n in measured if n.startswith("VLLM::")]) >= 2, measured  # engine core and worker seen

    weights = sum(f.stat().st_size for f in vllm_tiny.model_path.glob("*.safetensors"))
    server = vllm_cpu_server(tp=1, dp=1)
    planned = server.overhead + server.kv_cache + weights
    shown = ", ".join(f"{n} {v / MIB:.0f} MiB" for n, v in measured.items())
    assert total <= planned, f"measured {total / MIB:.0f} MiB > planned {planned / MIB:.0f} MiB: {shown}"
    assert planned <= 1.6 * total, f"planned {planned / MIB:.0f} MiB, measured only {total / MIB:.0f}: {shown}"
