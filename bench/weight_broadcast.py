"""Weight broadcast bandwidth: the trainer's weight sync (primebuild/runtime/weight_sync/broadcast.py) from rank 0
to every other rank, one process per rank, as the RL loop runs it between the trainer and vLLM.

    python bench/weight_broadcast.py                          # NCCL, one rank per visible GPU
    python bench/weight_broadcast.py --backend gloo --ranks 2 --gib 0.05   # on CPUs (what CI runs)

The payload is a state dict of bf16 tensors of `--tensor-mib` each, `--gib` in all (Qwen3-1.7B in bf16
is 3.4 GB). GB/s = payload bytes / wall time of `send` on rank 0 (after one warm-up update), median of
`--repeats`; every receiver checks the bytes it got. NCCL needs one GPU per rank: with fewer than two
GPUs there is nothing to measure, and the result says so (exit status 3).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

NOT_MEASURABLE = 3


def payload(gib: float, tensor_mib: float, device: str) -> dict[str, torch.Tensor]:
    per_tensor = max(1, int(tensor_mib * 2**20 / 2))  # bf16: 2 bytes per element
    count = max(1, int(gib * 2**30 / (per_tensor * 2)))
    generator = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(per_tensor, generator=generator).to(torch.bfloat16).to(device)
            for i in range(count)}


def _rank(rank: int, args: argparse.Namespace, port: int, results) -> None:
    from primebuild.runtime.weight_sync.broadcast import BroadcastReceiver, BroadcastSender

    device = f"cuda:{rank}" if args.backend == "nccl" else "cpu"
    if args.backend == "nccl":
        torch.cuda.set_device(rank)
    init = f"tcp://127.0.0.1:{port}"
    if rank == 0:
        weights = payload(args.gib, args.tensor_mib, device)
        sender = BroadcastSender(init, args.ranks, backend=args.backend, device=device, bucket_mb=args.bucket_mib)
        seconds = []
        for step in range(args.repeats + 1):  # the first one warms NCCL's channels up
            if args.backend == "nccl":
                torch.cuda.synchronize()
            start = time.perf_counter()
            sender.send(weights, step)
            if args.backend == "nccl":
                torch.cuda.synchronize()
            if step:
                seconds.append(time.perf_counter() - start)
        sender.close()
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        results.put({"rank": 0, "bytes": nbytes, "seconds": seconds})
        return
    receiver = BroadcastReceiver(init, args.ranks, rank, backend=args.backend, device=device)
    expected = payload(args.gib, args.tensor_mib, "cpu")
    updates, weights = 0, {}
    while (update := receiver.recv()) is not None:
        _, weights = update
        updates += 1
    same = bool(weights) and all(torch.equal(weights[k].cpu(), v) for k, v in expected.items())  # the last update
    results.put({"rank": rank, "updates": updates, "bytes_equal": same})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    parser.add_argument("--ranks", type=int, default=None, help="default: every visible GPU (nccl), 2 (gloo)")
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--tensor-mib", type=float, default=64.0)
    parser.add_argument("--bucket-mib", type=float, default=1024.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="results JSON")
    args = parser.parse_args(argv)
    if args.ranks is None:
        args.ranks = torch.cuda.device_count() if args.backend == "nccl" else 2
    result: dict = {"backend": args.backend, "ranks": args.ranks}
    if args.backend == "nccl" and (args.ranks < 2 or torch.cuda.device_count() < args.ranks):
        result["not_measurable"] = (f"NCCL needs one GPU per rank and a broadcast two ranks: "
                                    f"{torch.cuda.device_count()} GPU(s) visible")
        _write(args.out, result)
        return NOT_MEASURABLE
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args, port, results)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    got = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    sender = next(g for g in got if g["rank"] == 0)
    receivers = [g for g in got if g["rank"] != 0]
    median = statistics.median(sender["seconds"])
    result.update({"payload_gb": sender["bytes"] / 1e9, "seconds": sender["seconds"],
                   "gb_per_s": sender["bytes"] / 1e9 / median,
                   "receivers_bytes_equal": all(r["bytes_equal"] for r in receivers),
                   "receiver_updates": [r["updates"] for r in receivers]})
    _write(args.out, result)
    ok = result["receivers_bytes_equal"] and all(p.exitcode == 0 for p in procs)
    return 0 if ok else 1


def _write(out: Path | None, result: dict) -> None:
    text = json.dumps(result, indent=2, sort_keys=True)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
