"""Weight broadcast: the trainer's weight sync (primebuild/runtime/weight_sync/broadcast.py) from rank 0 to
every other rank, one process per rank, as the RL loop runs it between the trainer and vLLM, beside a raw
broadcast of the same bytes in the same bucket sizes on the same ranks (a second process group), the two
alternating sync by sync (a load change on a shared machine hits both alike; delta's raw runs after).

    python bench/weight_broadcast.py                          # NCCL, one rank per visible GPU
    python bench/weight_broadcast.py --backend gloo --ranks 3 --gib 0.25    # on CPUs
    # delta sync (weight_sync.delta) of a model trained between syncs: bytes per sync vs full
    python bench/weight_broadcast.py --backend gloo --ranks 3 --model bench/models/qwen3-120m.json \\
        --dtype bfloat16 --lr 1e-6 --repeats 3 --bucket-mib 16 --delta

    # FP8 servers: the matmul weights cross block-quantised (bytes per sync: published vs wire)
    python bench/weight_broadcast.py --backend gloo --ranks 3 --model bench/models/qwen3-120m.json --fp8

Payload: a state dict of bf16 matrices of `--tensor-mib` each, `--gib` in all (Qwen3-1.7B in bf16 is 3.4 GB);
or with `--model` (an HF folder, or a config.json / facts file for random weights) that model's weights in
`--dtype`, trained between syncs by AdamW at `--lr` (fp32 master weights, a language-model loss on fixed
random tokens), as the trainer publishes them. Per sync: full and wire bytes, and seconds from the moment
every receiver asked for the tensors to the last bucket sent (GB/s = wire bytes / seconds). Receivers copy
each bucket into a model-sized copy of their own (a server's load) and check their last copy bit for bit
against the sender's. NCCL needs one GPU per rank: with fewer than two GPUs there is nothing to measure,
and the result says so (exit status 3).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as mp

NOT_MEASURABLE = 3


def synthetic(gib: float, tensor_mib: float) -> dict[str, torch.Tensor]:
    """bf16 matrices [rows, 1024] named as decoder layers' projections (so `--fp8` quantises them)."""
    rows = max(1, int(tensor_mib * 2**20 / 2 / 1024))  # bf16: 2 bytes per element
    count = max(1, int(gib * 2**30 / (rows * 1024 * 2)))
    generator = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.mlp.down_proj.weight": (torch.randn(rows, 1024, generator=generator) * 0.02)
            .to(torch.bfloat16) for i in range(count)}


class TrainedModel:
    """A model whose published weights change by one AdamW step between syncs, as the trainer's do."""

    def __init__(self, source: str, dtype: str, lr: float):
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        path = Path(source)
        if path.is_dir():
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        else:  # a config.json or a model facts file (manifests/models/*.json): random weights
            raw = {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}
            config = AutoConfig.for_model(raw.pop("model_type"), **raw)
            self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        self.dtype = getattr(torch, dtype)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        vocab = self.model.config.vocab_size
        self.tokens = torch.randint(0, vocab, (8, 64), generator=torch.Generator().manual_seed(1))

    def published(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to(self.dtype) for k, v in self.model.state_dict().items()}

    def step(self) -> None:
        loss = self.model(input_ids=self.tokens, labels=self.tokens).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def raw_once(buffers: list[torch.Tensor], device: torch.device) -> float:
    """Seconds of plain broadcasts of `buffers` on the default group (every rank calls it)."""
    import torch.distributed as dist

    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    for buffer in buffers:
        dist.broadcast(buffer, src=0)
    _sync(device)
    return time.perf_counter() - start


def raw_broadcast(sizes: list[int], device: torch.device, repeats: int) -> list[float]:
    """Seconds of `repeats` raw broadcasts of buffers of `sizes` bytes, after a warm-up one."""
    buffers = [torch.zeros(n, dtype=torch.uint8, device=device) for n in sizes]
    return [raw_once(buffers, device) for _ in range(repeats + 1)][1:]


def _rank(rank: int, args: argparse.Namespace, ports: tuple[int, int], results) -> None:
    import torch.distributed as dist

    from primebuild.runtime.weight_sync.broadcast import BroadcastReceiver, BroadcastSender
    from primebuild.runtime.weight_sync.buckets import bucket_counts, bucket_sizes
    from primebuild.runtime.weight_sync.stream import InMemoryWeights, TensorSpec

    torch.set_num_threads(args.threads)
    device = torch.device(f"cuda:{rank}" if args.backend == "nccl" else "cpu")
    if args.backend == "nccl":
        torch.cuda.set_device(rank)
    init = f"tcp://127.0.0.1:{ports[0]}"
    report: dict = {"rank": rank}
    # raw's group (a second one, beside the sender's). Without delta, raw and ours alternate sync by sync,
    # so that a change of load on a shared machine hits both alike; delta's raw runs after (its sizes are
    # known only once its syncs were measured).
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{ports[1]}", rank=rank,
                            world_size=args.ranks, timeout=timedelta(seconds=300))
    interleaved = not args.delta
    raw_seconds: list[float] = []

    def on_the_wire(weights):  # --fp8: the trainer's FP8 wire format, quantised inside send() (timed)
        if not args.fp8:
            return weights
        from primebuild.runtime.weight_sync.fp8_wire import Fp8Wire

        return Fp8Wire(InMemoryWeights(weights), torch.float32)

    if rank == 0:
        model = TrainedModel(args.model, args.dtype, args.lr) if args.model else None
        weights = model.published() if model else synthetic(args.gib, args.tensor_mib)
        layout = (on_the_wire(weights).layout if args.fp8
                  else [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in weights.items()])
        shared = [bucket_sizes(layout, bucket_counts(layout, max(1, int(args.bucket_mib * 2**20))))]
    else:
        shared = [None]
    dist.broadcast_object_list(shared, src=0)
    full_sizes = shared[0]
    raw_buffers = [torch.zeros(n, dtype=torch.uint8, device=device) for n in full_sizes] if interleaved else []
    if rank == 0:
        sender = BroadcastSender(init, args.ranks, backend=args.backend, device=device, bucket_mb=args.bucket_mib,
                                 delta=args.delta)
        syncs = []
        for step in range(args.syncs + 1):  # the first one warms the transport up (and is delta's full base)
            stats = sender.send(on_the_wire(weights), step)
            if interleaved:  # after ours: the receivers join the sender's group in their first announcement()
                raw_seconds.append(raw_once(raw_buffers, device))
            syncs.append({"step": step, "published_bytes": sum(t.nbytes for t in weights.values()),
                          "full_bytes": stats.full_bytes, "wire_bytes": stats.wire_bytes,
                          "buckets": stats.buckets, "transfer_s": stats.transfer_s, "encodings": stats.encodings})
            if model and step < args.syncs:
                model.step()
                weights = model.published()
        sender.close()
        sent = on_the_wire(weights)
        sent = dict(t for group in sent.groups() for t in group) if args.fp8 else sent
        report.update(syncs=syncs, digest=digest(sent))
        wire = statistics.median(s["wire_bytes"] for s in syncs[1:])
        scale = wire / sum(full_sizes)  # delta: the same buckets, each as much smaller as the syncs were
        wire_sizes = [max(1, int(n * scale)) for n in full_sizes]
    else:
        receiver = BroadcastReceiver(init, args.ranks, rank, backend=args.backend, device=device)
        served: dict[str, torch.Tensor] = {}

        def load(bucket):
            for name, tensor in bucket:
                if name not in served:
                    served[name] = torch.empty_like(tensor, device="cpu")
                served[name].copy_(tensor)

        updates = 0
        for _ in range(args.syncs + 1):
            if receiver.pull(receiver.announcement(), load):
                updates += 1
            if interleaved:
                raw_seconds.append(raw_once(raw_buffers, device))
        if receiver.announcement() is not None:  # (tells the sender this receiver saw it close)
            raise RuntimeError("the sender sent more updates than the bench asked for")
        report.update(updates=updates, digest=digest(served))
        wire_sizes = None
    if interleaved:
        report["raw_seconds"] = raw_seconds[1:]
    else:
        shared = [wire_sizes]
        dist.broadcast_object_list(shared, src=0)
        report["raw_seconds"] = raw_broadcast(shared[0], device, args.repeats)
        # what sending every byte raw takes, the time delta has to beat
        report["raw_full_seconds"] = raw_broadcast(full_sizes, device, args.repeats)
    dist.destroy_process_group()
    results.put(report)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    parser.add_argument("--ranks", type=int, default=None, help="default: every visible GPU (nccl), 2 (gloo)")
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--tensor-mib", type=float, default=64.0)
    parser.add_argument("--bucket-mib", type=float, default=1024.0)
    parser.add_argument("--repeats", type=int, default=3, help="syncs measured (after a warm-up one)")
    parser.add_argument("--model", default=None, help="an HF folder, or a config.json / facts file (random weights)")
    parser.add_argument("--dtype", default="bfloat16", help="the published dtype (--model)")
    parser.add_argument("--lr", type=float, default=1e-6, help="AdamW's learning rate between syncs (--model)")
    parser.add_argument("--delta", action="store_true", help="weight_sync.delta: only changed elements travel")
    parser.add_argument("--fp8", action="store_true",
                        help="FP8 servers: the matmul weights cross block-quantised (weight_sync/fp8_wire.py)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--out", type=Path, default=None, help="results JSON")
    args = parser.parse_args(argv)
    args.syncs = args.repeats
    if args.ranks is None:
        args.ranks = torch.cuda.device_count() if args.backend == "nccl" else 2
    result: dict = {"backend": args.backend, "ranks": args.ranks, "bucket_mib": args.bucket_mib, "delta": args.delta,
                    "fp8": args.fp8}
    if args.model:
        result.update(model=args.model, dtype=args.dtype, lr=args.lr)
    if args.backend == "nccl" and (args.ranks < 2 or torch.cuda.device_count() < args.ranks):
        result["not_measurable"] = (f"NCCL needs one GPU per rank and a broadcast two ranks: "
                                    f"{torch.cuda.device_count()} GPU(s) visible")
        _write(args.out, result)
        return NOT_MEASURABLE
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args, tuple(ports), results)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    got = [results.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    sender = next(g for g in got if g["rank"] == 0)
    receivers = [g for g in got if g["rank"] != 0]
    measured = sender["syncs"][1:]
    seconds = [s["transfer_s"] for s in measured]
    wire = statistics.median(s["wire_bytes"] for s in measured)
    raw = statistics.median(sender["raw_seconds"])
    result.update({
        "payload_gb": sender["syncs"][0]["full_bytes"] / 1e9, "buckets": sender["syncs"][0]["buckets"],
        # bytes per sync: as published (bf16 with --dtype bfloat16) and what crossed (fp8 with --fp8)
        "published_bytes": sender["syncs"][0]["published_bytes"], "wire_bytes_per_sync": wire,
        "syncs": [{**s, "wire_fraction": round(s["wire_bytes"] / s["full_bytes"], 6)} for s in sender["syncs"]],
        "seconds": seconds, "gb_per_s": wire / 1e9 / statistics.median(seconds),
        "raw_seconds": sender["raw_seconds"], "raw_gb_per_s": wire / 1e9 / raw,
        "vs_raw": raw / statistics.median(seconds),
        # full bytes per second of our sync: with delta, beside a raw broadcast of every byte
        "full_gb_per_s": sender["syncs"][0]["full_bytes"] / 1e9 / statistics.median(seconds),
        **({"raw_full_seconds": sender["raw_full_seconds"],
            "vs_raw_full": statistics.median(sender["raw_full_seconds"]) / statistics.median(seconds)}
           if args.delta else {}),
        "receivers_bytes_equal": all(r["digest"] == sender["digest"] for r in receivers),
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
