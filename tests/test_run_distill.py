"""On-policy distillation end to end: `primebuild run manifests/reverse-text-distill.yaml`, shrunk. The
teacher (a short SFT of the wider model) is built into the store and served by its own embedded server;
every batch's samples carry its log-probs, which equal the teacher model's own (transformers, 1e-5 fp32),
and the trainer logs the reverse KL to it each step."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import MANIFESTS, SHORT_SFT, run_shrunk, sft_workspace

torch = pytest.importorskip("torch")

from primebuild.runtime.rollout_file import load_batch  # noqa: E402

pytestmark = pytest.mark.timeout(600)
STEPS = 3


@pytest.fixture(scope="module")
def distill_run(tmp_path_factory, short_sft_store) -> tuple[subprocess.CompletedProcess, Path]:
    root = tmp_path_factory.mktemp("distill")
    manifests = sft_workspace(root, ("reverse-text.yaml", "reverse-text-distill.yaml"), seed_store=short_sft_store)
    teacher = yaml.safe_load((MANIFESTS / "reverse-text-teacher-sft.yaml").read_text())
    teacher["sft"].update(SHORT_SFT)
    (manifests / "reverse-text-teacher-sft.yaml").write_text(yaml.safe_dump(teacher))
    return run_shrunk(manifests / "reverse-text-distill.yaml", root, f"orchestrator.max_steps={STEPS}", timeout=580)


def test_a_run_with_a_teacher_trains_on_its_logprobs(distill_run):
    result, run_dir = distill_run
    assert result.returncode == 0, result.stdout + result.stderr
    assert "teacher: " in result.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    kl = {r["step"]: r["value"] for r in rows if r["role"] == "trainer" and r["name"] == "teacher_kl"}
    assert sorted(kl) == list(range(1, STEPS + 1)) and all(isinstance(v, float) for v in kl.values())


def test_batch_teacher_logprobs_equal_the_teacher_models_own(distill_run):
    from transformers import AutoModelForCausalLM

    result, run_dir = distill_run
    assert result.returncode == 0, result.stdout + result.stderr
    teacher_path = json.loads((run_dir / "run.json").read_text())["teacher_model_path"]
    teacher = AutoModelForCausalLM.from_pretrained(teacher_path, dtype=torch.float32)
    batch = load_batch(next((run_dir / "rollouts").glob("step_000001.*")))
    checked = 0
    for sample in batch.samples[:8]:
        ids = sample.prompt_ids + sample.completion_ids
        with torch.inference_mode():
            logits = teacher(torch.tensor([ids])).logits[0, :-1].float()
        own = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
        own = own[len(sample.prompt_ids) - 1:]
        assert sample.teacher_logprobs is not None and len(sample.teacher_logprobs) == len(sample.completion_ids)
        torch.testing.assert_close(torch.tensor(sample.teacher_logprobs, dtype=torch.float32), own, atol=1e-5, rtol=0)
        checked += len(own)
    assert checked > 0
