"""Weight sync on CPU: the plan's seconds per sync (timing.cpu_weight_sync_estimate) beside measured ones.

    python bench/weight_sync_time.py --model manifests/models/reverse-text-tiny.json --dtype float32
    python bench/weight_sync_time.py --model bench/models/qwen3-120m.json --dtype bfloat16

One process per member, as the run has them: a sender (the trainer) and `--receivers` servers, random
weights of `--model` (a config.json or facts file) in `--dtype`, both modes of weight_sync:
- filesystem: the sender publishes a step folder (weight_sync/filesystem.py: safetensors, sha256 listing,
  fsync, rename); every receiver, polling for it, verifies it (sha256) and loads it into a model-sized copy
  of its own. Seconds: publish start to the last receiver loaded.
- broadcast: BroadcastSender.send to receivers that copy every bucket into their copy (weight_sync/
  broadcast.py, gloo over loopback, the plan's default bucket size). Seconds: send() of the sender
  (announce, wait for every receiver to ask, every bucket).
Median of `--repeats` syncs after a warm-up one. The estimate is the one the plan prints for a CPU manifest
(primebuild/builders/budget.py), from the plan's byte count of the model (builders/memory.weight_bytes).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16"}


def random_model(source: str, dtype: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    raw = {k: v for k, v in json.loads(Path(source).read_text()).items() if not k.startswith("_")}
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    return {k: v.detach().contiguous() for k, v in model.state_dict().items()}, config


def _copy_into(served: dict[str, torch.Tensor], pieces) -> None:
    for name, tensor in pieces:
        if name not in served:
            served[name] = torch.empty_like(tensor, device="cpu")
        served[name].copy_(tensor)


def _filesystem_rank(rank: int, args, root: str, results) -> None:
    from primebuild.runtime.weight_sync import filesystem as fs

    torch.set_num_threads(1)
    if rank == 0:
        weights, config = random_model(args.model, args.dtype)
        for step in range(args.repeats + 1):
            start = time.time()
            fs.publish_hf_weights(root, step, weights, config)
            results.put(("published", step, start, time.time()))
            while not Path(root, f"done_{step}").exists() and step < args.repeats:  # one sync at a time
                time.sleep(0.005)
        return
    from safetensors.torch import load_file

    served: dict[str, torch.Tensor] = {}
    for step in range(args.repeats + 1):
        folder = fs.wait_for_step(root, step, timeout_s=600, poll_s=0.01)
        fs.verify(folder)
        _copy_into(served, load_file(folder / "model.safetensors").items())
        results.put(("loaded", step, rank, time.time()))


def _broadcast_rank(rank: int, args, port: int, results) -> None:
    from primebuild.contracts.trainer import DEFAULT_BUCKET_MB
    from primebuild.runtime.weight_sync.broadcast import BroadcastReceiver, BroadcastSender

    torch.set_num_threads(1)
    init, world = f"tcp://127.0.0.1:{port}", args.receivers + 1
    if rank == 0:
        weights, _ = random_model(args.model, args.dtype)
        sender = BroadcastSender(init, world, backend="gloo", bucket_mb=DEFAULT_BUCKET_MB)
        for step in range(args.repeats + 1):
            start = time.perf_counter()
            stats = sender.send(weights, step)
            results.put(("sent", step, time.perf_counter() - start, stats.transfer_s))
        sender.close()
        return
    receiver = BroadcastReceiver(init, world, rank, backend="gloo")
    served: dict[str, torch.Tensor] = {}
    while (announced := receiver.announcement()) is not None:
        receiver.pull(announced, lambda bucket: _copy_into(served, bucket))
    receiver.close()


def measure(mode: str, args) -> tuple[list[float], list[float]]:
    """Seconds of each sync after the warm-up one, and of its write part (filesystem: the publish;
    broadcast: send() less its transfer)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    world = args.receivers + 1
    with tempfile.TemporaryDirectory(dir=args.tmp) as root:
        if mode == "filesystem":
            procs = [ctx.Process(target=_filesystem_rank, args=(r, args, root, results)) for r in range(world)]
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            procs = [ctx.Process(target=_broadcast_rank, args=(r, args, port, results)) for r in range(world)]
        for p in procs:
            p.start()
        seconds: list[float] = []
        write: list[float] = []
        if mode == "filesystem":
            starts, loaded = {}, {}
            while len(seconds) < args.repeats + 1:
                kind, step, *rest = results.get(timeout=1800)
                if kind == "published":
                    starts[step] = rest[0]
                    write.append(rest[1] - rest[0])
                else:
                    loaded.setdefault(step, []).append(rest[1])
                    if len(loaded[step]) == args.receivers:
                        Path(root, f"done_{step}").touch()
                        seconds.append(max(loaded[step]) - starts[step])
        else:
            while len(seconds) < args.repeats + 1:
                _, _, total, transfer = results.get(timeout=1800)
                seconds.append(total)
                write.append(total - transfer)
        for p in procs:
            p.join(timeout=120)
        if any(p.exitcode != 0 for p in procs):
            raise SystemExit(f"{mode}: a rank failed (exit codes {[p.exitcode for p in procs]})")
    return seconds[1:], write[1:]


def main(argv: list[str] | None = None) -> int:
    from primebuild.builders.memory import weight_bytes
    from primebuild.builders.model_facts import load_model_facts
    from primebuild.builders.timing import cpu_weight_sync_estimate

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a config.json or facts file (random weights)")
    parser.add_argument("--dtype", default="float32", choices=sorted(_DTYPE_NAMES))
    parser.add_argument("--receivers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--modes", nargs="+", default=["filesystem", "broadcast"], choices=["filesystem", "broadcast"])
    parser.add_argument("--repeats", type=int, default=5, help="syncs measured (after a warm-up one)")
    parser.add_argument("--tmp", default=None, help="where step folders go (the run folder's file system)")
    parser.add_argument("--out", type=Path, default=None, help="results JSON")
    args = parser.parse_args(argv)
    size = sum(weight_bytes(load_model_facts(args.model), _DTYPE_NAMES[args.dtype]))
    rows = []
    print(f"{args.model} in {args.dtype}: {size / 1e6:,.1f} MB per sync (the plan's count)")
    print(f"{'mode':<11} {'receivers':>9} {'plan s':>8} {'measured s (median)':>20} {'plan/measured':>14} "
          f"{'plan write s':>13} {'measured write s':>17}  all measured")
    for mode in args.modes:
        for receivers in args.receivers:
            seconds, write = measure(mode, argparse.Namespace(**{**vars(args), "receivers": receivers}))
            estimate = cpu_weight_sync_estimate(size, mode=mode, receivers=receivers)
            plan, median = estimate.seconds, statistics.median(seconds)
            rows.append(dict(mode=mode, receivers=receivers, bytes=size, plan_s=plan, measured_s=median,
                             all_measured_s=seconds, ratio=plan / median, plan_write_s=estimate.write_seconds,
                             measured_write_s=statistics.median(write), all_measured_write_s=write))
            print(f"{mode:<11} {receivers:>9} {plan:>8.3f} {median:>20.3f} {plan / median:>14.2f} "
                  f"{estimate.write_seconds:>13.3f} {statistics.median(write):>17.3f}  "
                  f"{' '.join(f'{s:.3f}' for s in seconds)}", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(model=args.model, dtype=args.dtype, rows=rows), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
