"""Embedded P/D vs the unified engine on one step's worth of reverse-text requests: KV bytes and
seconds per request (from the servers' /metrics), and wall time side by side.

Servers run in this process on real uvicorn servers and ZMQ on loopback (as tests/test_inference_pd.py
does); the model is a folder given on the command line (default: the reverse-text SFT model in the store).
16 prompts x n=8 at temperature 1, 16 new tokens (one RL step of manifests/reverse-text.yaml), repeated.

    .venv/bin/python bench/pd.py [--model DIR] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from inference_helpers import free_port, running_server  # noqa: E402

from primebuild.contracts.router import DecodeServer, RouterConfig  # noqa: E402
from primebuild.runtime.inference.disaggregation import Disaggregation  # noqa: E402
from primebuild.runtime.inference.engine import Engine  # noqa: E402
from primebuild.runtime.inference.router import create_router  # noqa: E402
from primebuild.runtime.inference.server import create_app  # noqa: E402
from primebuild.runtime.inference.tokenizer import ServedTokenizer  # noqa: E402


def server(folder, role=None, inbox=None):
    tokenizer = ServedTokenizer(folder)
    engine = Engine(folder, device="cpu", max_num_seqs=128, max_model_len=64, eos_token_ids=tokenizer.eos_token_ids,
                    detokenize=tokenizer.decode)
    return engine, create_app(engine, tokenizer, served_model_name="m", admin_token="t",
                              pd=Disaggregation(role, inbox) if role else None)


def metric(url: str, name: str) -> float:
    found = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", httpx.get(url + "/metrics").text, re.M)
    return float(found.group(1))


async def step(url: str, prompts: list[str]) -> float:
    async with httpx.AsyncClient(timeout=300) as client:
        started = time.monotonic()
        answers = await asyncio.gather(*(client.post(url + "/v1/completions", json={
            "model": "m", "prompt": p, "n": 8, "max_tokens": 16, "temperature": 1.0, "logprobs": 0}) for p in prompts))
        assert all(a.status_code == 200 for a in answers)
        return time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser()
    store = sorted(Path.home().glob(".cache/primebuild/store/*-reverse-text-sft"))
    parser.add_argument("--model", default=str(store[-1]) if store else None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    prompts = ["".join(letters[i] for i in torch.randint(0, 26, (int(n),), generator=g)) + ">"
               for n in torch.randint(4, 13, (16,), generator=g)]
    inbox = f"tcp://127.0.0.1:{free_port()}"
    engines = [server(args.model), server(args.model, "prefill"), server(args.model, "decode", inbox)]
    try:
        with running_server(engines[0][1]) as unified, running_server(engines[1][1]) as prefill, \
                running_server(engines[2][1]) as decode:
            config = RouterConfig(served_model_name="m", port=1, prefill=[prefill],
                                  decode=[DecodeServer(url=decode, kv_address=inbox)])
            with running_server(create_router(config, "t")) as router:
                asyncio.run(step(router, prompts)), asyncio.run(step(unified, prompts))  # warm-up
                times = {"unified": [], "p/d": []}
                for _ in range(args.repeats):
                    times["unified"].append(asyncio.run(step(unified, prompts)))
                    times["p/d"].append(asyncio.run(step(router, prompts)))
                prefix = "primebuild_inference_kv_transfer_received"
                transfers = metric(decode, f"{prefix}_total")
                kv_bytes, tokens = metric(decode, f"{prefix}_bytes_total"), metric(decode, f"{prefix}_tokens_total")
                seconds = metric(decode, f"{prefix}_seconds_total")
                sent_seconds = metric(prefill, "primebuild_inference_kv_transfer_sent_seconds_total")
                logits = metric(decode, f"{prefix}_logits_bytes_total")
    finally:
        for engine, _ in engines:
            engine.shutdown()
    print(f"model {args.model}")
    print(f"{transfers:.0f} transfers: {kv_bytes / transfers:,.0f} KV bytes/request, {kv_bytes / tokens:.0f} bytes/token, "
          f"+{logits / transfers:,.0f} logits bytes/request")
    print(f"seconds/request: prefill side (KV ready -> sent) {sent_seconds / transfers * 1e3:.2f} ms, "
          f"decode side (sent -> received) {seconds / transfers * 1e3:.2f} ms")
    u, s = statistics.median(times["unified"]), statistics.median(times["p/d"])
    print(f"one step (16 prompts x 8 samples x 16 tokens), median of {args.repeats}: unified {u:.3f} s, "
          f"P/D {s:.3f} s, ratio {s / u:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
