"""Decode throughput of the embedded engine vs `transformers.generate`, plus tokens/s through HTTP.

Same model, same prompts (16 random ids), same thread count, greedy, exactly 64 new tokens (EOS
ignored by both), and the tokens of both are compared. Tokens/s = batch * 64 / wall time of the whole
call (prefill included for both). Medians of `--repeats` runs after one warm-up, the two contenders
alternating run by run.

The machine is shared, so wall times swing +-20-30 % with the load (printed with each row). The
process CPU time of each call is reported too: with one intra-op thread it is the work each contender
did (the engine thread's, as the caller only waits), and it moves far less with the load. Both
ratios are printed; the wall ratio is the headline.

A third contender is the engine in batch-invariant mode (`inference.batch_invariant`: matmuls on fixed row
blocks, attention and prefill one sequence at a time; primebuild/runtime/inference/batch_invariant.py): its
tok/s and its wall ratio to the default engine ("inv/eng") show what reproducible greedy evals cost.

    .venv/bin/python bench/engine.py [--threads 1] [--repeats 3] [--skip-20m] [--skip-http]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from primebuild.contracts.inference import InferenceServerConfig

PROMPT_LEN = 16
NEW_TOKENS = 64
MODELS = {
    # name: build_tiny_model kwargs
    "tiny (0.5M)": dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=512),
    "20M": dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=8, intermediate_size=1024),
}


def build(folder: Path, kwargs: dict) -> Path:
    from primebuild.runtime.models.tiny import build_tiny_model

    return build_tiny_model(folder, seed=0, **kwargs)


def prompts_for(batch: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(batch)
    return torch.randint(4, vocab, (batch, PROMPT_LEN), generator=generator).tolist()


def interleaved_medians(fns: list, repeats: int) -> list[tuple[float, float, object]]:
    """Run the contenders alternately (load on a shared machine drifts), after one warm-up each.

    Returns (median wall seconds, median process CPU seconds, last result) per contender.
    """
    results = [fn() for fn in fns]
    walls: list[list[float]] = [[] for _ in fns]
    cpus: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            cpu, start = time.process_time(), time.perf_counter()
            results[i] = fn()
            walls[i].append(time.perf_counter() - start)
            cpus[i].append(time.process_time() - cpu)
    return [
        (statistics.median(w), statistics.median(c), r) for w, c, r in zip(walls, cpus, results, strict=True)
    ]


def hf_runner(folder: Path, prompts: list[list[int]]):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)

    def run():
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                eos_token_id=None,
                pad_token_id=0,
            )
        return out[:, PROMPT_LEN:].tolist()

    return run


def engine_runner(engine, prompts: list[list[int]]):
    from primebuild.runtime.inference.sampling import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return lambda: [c[0].token_ids for c in engine.generate(prompts, params)]


@contextlib.contextmanager
def embedded_server(folder: Path, threads: int, admin_token: str = "bench", max_num_seqs: int = 64,
                    max_model_len: int = 128):
    """A real embedded server process on a free loopback port; yields its base URL."""
    import httpx

    with socket.socket() as probe:  # a free loopback port for the server
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, PRIMEBUILD_ADMIN_TOKEN=admin_token)
    config = Path(tempfile.mkdtemp(prefix="bench-server-")) / "server.json"
    config.write_text(InferenceServerConfig(model_path=str(folder), served_model_name="bench", port=port,
                                            max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                            num_threads=threads).model_dump_json())
    server = subprocess.Popen(
        [sys.executable, "-m", "primebuild.runtime.inference.server", "--config", str(config)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("server did not start")
            time.sleep(0.2)
        yield base
    finally:
        server.terminate()
        server.wait(timeout=30)


def bench_http(folder: Path, threads: int, clients: int, repeats: int) -> float:
    """End-to-end tokens/s: a real server process, `clients` concurrent streaming-free completions."""
    import httpx

    with embedded_server(folder, threads) as base:
        prompts = prompts_for(clients, 32)

        async def once() -> tuple[float, int]:
            async with httpx.AsyncClient(
                base_url=base, timeout=300, limits=httpx.Limits(max_connections=clients)
            ) as c:
                body = dict(model="bench", max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
                start = time.perf_counter()
                replies = await asyncio.gather(
                    *(c.post("/v1/completions", json={**body, "prompt": p}) for p in prompts)
                )
                wall = time.perf_counter() - start
            return wall, sum(r.json()["usage"]["completion_tokens"] for r in replies)

        asyncio.run(once())  # warm-up
        rates = []
        for _ in range(repeats):
            wall, tokens = asyncio.run(once())
            rates.append(tokens / wall)
        return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--skip-20m", action="store_true")
    parser.add_argument("--skip-http", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    print(
        f"torch {torch.__version__}, {args.threads} threads, fp32, greedy, prompt {PROMPT_LEN}, "
        f"{NEW_TOKENS} new tokens, median of {args.repeats}"
    )
    print(
        f"{'model':<12} {'batch':>5} {'generate tok/s':>15} {'engine tok/s':>13} {'ratio':>6} "
        f"{'CPU-time ratio':>15} {'same tokens':>12} {'invariant tok/s':>16} {'inv/eng':>8} {'load':>5}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name, kwargs in MODELS.items():
            if name == "20M" and args.skip_20m:
                continue
            from primebuild.runtime.inference.engine import Engine

            folder = build(Path(tmp) / name.split()[0], kwargs)
            engine = Engine(folder, max_num_seqs=64, max_model_len=PROMPT_LEN + NEW_TOKENS, device="cpu")
            invariant = Engine(folder, max_num_seqs=64, max_model_len=PROMPT_LEN + NEW_TOKENS, device="cpu",
                               batch_invariant=True)
            for batch in batches:
                prompts = prompts_for(batch, 32)
                (hf_time, hf_cpu, hf_tokens), (engine_time, engine_cpu, engine_tokens), (inv_time, _, _) = \
                    interleaved_medians([hf_runner(folder, prompts), engine_runner(engine, prompts),
                                         engine_runner(invariant, prompts)], args.repeats)
                total = batch * NEW_TOKENS
                print(
                    f"{name:<12} {batch:>5} {total / hf_time:>15.0f} {total / engine_time:>13.0f} "
                    f"{hf_time / engine_time:>5.2f}x {hf_cpu / engine_cpu:>14.2f}x "
                    f"{str(hf_tokens == engine_tokens):>12} {total / inv_time:>16.0f} "
                    f"{engine_time / inv_time:>7.2f}x {os.getloadavg()[0]:>5.1f}",
                    flush=True,
                )
            engine.shutdown()
            invariant.shutdown()
        if not args.skip_http:
            folder = Path(tmp) / "tiny"
            rate = bench_http(folder, args.threads, 64, args.repeats)
            print(f"HTTP end to end, tiny model, 64 concurrent clients: {rate:.0f} completion tok/s")


if __name__ == "__main__":
    main()
