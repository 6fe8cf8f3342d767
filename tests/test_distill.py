"""On-policy distillation, piece by piece: the teacher's prompt log-probs (embedded engine, HTTP shape),
the teacher_logprobs field through the rollout file and the trainer's packing, the advantage penalty's
gradient on a hand-made batch, and the plan (teacher server placed, memory counted, a teacher with
another tokenizer refused, located). The end-to-end run is tests/test_run_distill.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

torch = pytest.importorskip("torch")

from primebuild.contracts.rollout import RolloutBatch, Sample  # noqa: E402
from primebuild.errors import UserError  # noqa: E402
from primebuild.runtime.rollout_file import load_batch, save_batch  # noqa: E402
from primebuild.runtime.trainer.batch import pack  # noqa: E402
from primebuild.runtime.trainer.distill import distilled_advantages, teacher_baseline  # noqa: E402
from primebuild.runtime.trainer.losses import resolve_loss  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _sample(prompt, completion, mu, tau, advantage=0.0, mask=None) -> Sample:
    return Sample(prompt_ids=prompt, completion_ids=completion, inference_logprobs=mu, teacher_logprobs=tau,
                  advantage=advantage, reward=0.0, policy_version=0, completion_mask=mask)


# --- the engine: prompt log-probs are the model's own ---------------------------------------------------


def test_engine_prompt_logprobs_equal_the_models_own(tmp_path):
    """The teacher's server scores with Qwen3Forward.score: equal (1e-5, fp32) to transformers' forward of
    the same folder, for every token after the first."""
    from transformers import AutoModelForCausalLM

    from primebuild.runtime.inference.engine import Engine
    from primebuild.runtime.models.tiny import build_tiny_model

    folder = build_tiny_model(tmp_path / "teacher", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                              intermediate_size=128, seed=3)
    engine = Engine(folder, max_num_seqs=2, max_model_len=64, device="cpu")
    try:
        ids = [1, 7, 9, 4, 12, 3, 20, 5, 2]
        ours = torch.tensor(engine.prompt_logprobs(ids))
    finally:
        engine.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.inference_mode():
        logits = hf(torch.tensor([ids])).logits[0, :-1].float()
    theirs = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    assert ours.shape == (len(ids) - 1,)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_prompt_logprobs_response_shape():
    """vLLM's shape: None for the first token, then {token id: {"logprob": x}}; choice i answers prompt i // n."""
    import json

    from fastapi.responses import JSONResponse

    from primebuild.runtime.inference.responses import with_prompt_logprobs

    answer = JSONResponse({"choices": [{"index": 0}, {"index": 1}, {"index": 2}, {"index": 3}]})
    shaped = json.loads(with_prompt_logprobs(answer, [[5, 6, 7], [8, 9]], [[-0.5, -1.5], [-2.0]], n=2).body)
    assert [c["prompt_logprobs"] for c in shaped["choices"][:2]] == [[None, {"6": {"logprob": -0.5}},
                                                                      {"7": {"logprob": -1.5}}]] * 2
    assert shaped["choices"][3]["prompt_logprobs"] == [None, {"9": {"logprob": -2.0}}]


# --- the batch: teacher_logprobs travel and are laid out per token -----------------------------------------


def test_teacher_logprobs_survive_the_rollout_file(tmp_path):
    samples = [_sample([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], [-0.7, -0.25, -1e-7], 1.0),
               _sample([1], [6], [-0.4], None)]
    save_batch(tmp_path / "b.safetensors", RolloutBatch(step=1, samples=samples))
    back = load_batch(tmp_path / "b.safetensors").samples
    assert back[0].teacher_logprobs == [-0.7, -0.25, -1e-7] and back[1].teacher_logprobs is None
    with pytest.raises(UserError, match="2 teacher_logprobs for 3 completion tokens"):
        _sample([1], [3, 4, 5], [-0.1] * 3, [-0.1] * 2).validate_shapes("batch")


def test_distillation_penalty_gradient_sign_and_size():
    """A = 0, so only the teacher speaks: with the trainer at the sampler's log-probs (ratio 1), grpo's
    gradient on each trained token's log-prob is exactly weight x (mu - tau - k̄) / normaliser, k̄ the mean
    of mu - tau over the trained tokens (0.4/3 here): a token the student is surer of than the teacher
    (beyond the mean) is pushed down, one the teacher prefers is pushed up; prompt tokens and masked
    tokens get nothing."""
    weight = 0.5
    mu, tau = [-0.2, -1.0, -0.7, -0.3], [-1.2, -0.4, -0.7, -5.0]
    samples = [_sample([1, 2], [3, 4, 5, 6], mu, tau, mask=[1, 1, 1, 0])]
    baseline = teacher_baseline(samples)
    assert baseline == pytest.approx((1.0 - 0.6 + 0.0) / 3)  # the masked token's 4.7 is not in it
    (mb,), = pack(samples, micro_batch_tokens=64, world_size=1)
    assert mb.teacher_logprobs[0, 2:].tolist() == pytest.approx(tau)
    logprobs = mb.inference_logprobs.clone().requires_grad_()
    advantages = distilled_advantages(mb.advantages, mb.inference_logprobs, mb.teacher_logprobs, weight, baseline)
    loss, _ = resolve_loss("grpo")(logprobs, mb.inference_logprobs, advantages, mb.loss_mask)
    loss.backward()
    grad = logprobs.grad[0].tolist()
    assert grad[:2] == [0.0, 0.0]  # the prompt
    want = [weight * (k - baseline) for k in (1.0, -0.6, 0.0)] + [0.0]
    assert grad[2:] == pytest.approx(want, abs=1e-6)
    assert grad[2] > 0 > grad[3]  # descent lowers the overconfident token, raises the teacher's favourite
    # uncentred (baseline 0): the penalty itself, weight x (mu - tau)
    uncentred = distilled_advantages(mb.advantages, mb.inference_logprobs, mb.teacher_logprobs, weight)
    assert (-uncentred[0, 2:5]).tolist() == pytest.approx([0.5, -0.3, 0.0], abs=1e-6)


def test_samples_without_a_teacher_get_no_penalty():
    """A row mixing scored and unscored samples: the unscored one (and every prompt token) is NaN in the
    teacher column and keeps its advantage; the scored one's tokens get the centred penalty."""
    samples = [_sample([1], [3, 4], [-0.2, -0.9], [-1.0, -1.0], advantage=0.5), _sample([1], [5], [-0.6], None, 0.25)]
    (mb,), = pack(samples, micro_batch_tokens=64, world_size=1)
    baseline = teacher_baseline(samples)
    assert baseline == pytest.approx((0.8 + 0.1) / 2)
    got = distilled_advantages(mb.advantages, mb.inference_logprobs, mb.teacher_logprobs, 1.0, baseline)[0].tolist()
    assert sorted(round(x, 6) for x in got) == sorted(round(x, 6) for x in [0.0, 0.0, 0.5 - 0.35, 0.5 + 0.35, 0.25])
    assert pack([_sample([1], [5], [-0.6], None)], 64, 1)[0][0].teacher_logprobs is None


# --- the plan --------------------------------------------------------------------------------------------


def _workspace(tmp_path: Path, teacher: str) -> Path:
    manifests = tmp_path / "manifests"
    shutil.copytree(REPO / "manifests" / "models", manifests / "models")
    for name in ("reverse-text.yaml", "reverse-text-sft.yaml", "reverse-text-teacher-sft.yaml", "tool-use-sft.yaml"):
        shutil.copy(REPO / "manifests" / name, manifests / name)
    doc = yaml.safe_load((REPO / "manifests" / "reverse-text-distill.yaml").read_text())
    doc["distill"]["teacher"]["from_manifest"] = teacher
    (manifests / "reverse-text-distill.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return manifests / "reverse-text-distill.yaml"


def test_plan_places_the_teacher_and_counts_its_memory(tmp_path):
    from conftest import plan_json

    plan = plan_json(_workspace(tmp_path, "reverse-text-teacher-sft.yaml"), design=False)
    by_name = {p["name"]: p for p in plan["processes"]}
    teacher = by_name["teacher-0"]
    assert teacher["role"] == "teacher" and teacher["config"]["model_path"] == "{teacher_model_path}"
    port = teacher["ports"]["http"]
    assert by_name["orchestrator"]["config"]["teacher"]["url"] == f"http://{{host:0}}:{port}/v1"
    assert by_name["trainer"]["config"]["distill_weight"] == 0.02
    memory = plan["memory"]["teacher"]
    assert memory["breakdown"]["weights"] > 2 * plan["memory"]["inference"]["breakdown"]["weights"]  # the wider model


def test_with_vllm_the_teacher_is_a_vllm_server_counted_as_its_processes(tmp_path):
    from conftest import plan_json

    from primebuild.builders.vllm_cpu_memory import vllm_cpu_server

    manifest = _workspace(tmp_path, "reverse-text-teacher-sft.yaml")
    plan = plan_json(manifest, ["inference.engine=vllm"], design=False)
    teacher = {p["name"]: p for p in plan["processes"]}["teacher-0"]
    assert teacher["environment"] == "vllm" and "{teacher_model_path}" in teacher["argv"]
    assert teacher["env"]["VLLM_CPU_KVCACHE_SPACE"] == "1" and "weight" not in " ".join(teacher["argv"])
    served = teacher["argv"][teacher["argv"].index("--served-model-name") + 1]
    orchestrator = {p["name"]: p for p in plan["processes"]}["orchestrator"]
    assert orchestrator["config"]["teacher"]["served_model_name"] == served
    server = vllm_cpu_server(1, 1)
    memory = plan["memory"]["teacher"]["breakdown"]
    assert memory["overhead"] == server.overhead and memory["kv_cache"] == server.kv_cache


GPU_DISTILL = """\
apiVersion: primebuild/v1
name: gpu-distill
model: {from_manifest: reverse-text-sft.yaml, dtype: bfloat16}
hardware: {nodes: 3, gpus_per_node: 8, gpu: h200, host_memory_gb: 2048}
inference: {engine: vllm, precision: bf16, replicas: 8}
trainer: {dp_shard: 8, precision: bf16}
orchestrator: {rollouts_per_step: 512, group_size: 8, seq_len: 64, max_completion_tokens: 16, max_steps: 10,
               temperature: 1.0}
environments: [{id: reverse-text}]
distill: {teacher: {from_manifest: reverse-text-teacher-sft.yaml}, tp: 3}
target: {kind: slurm, partition: gpu}
"""


def test_on_gpus_the_teacher_gets_a_node_of_its_own_its_memory_and_its_scoring_time(tmp_path):
    from conftest import plan_json

    from primebuild.builders.distill import teacher_facts
    from primebuild.builders.hardware import gpu_spec
    from primebuild.builders.model_facts import facts_from_hf_config
    from primebuild.builders.model_ref import read_facts_json
    from primebuild.builders.timing import teacher_scoring_seconds
    from primebuild.manifest.load import load_manifest

    _workspace(tmp_path, "reverse-text-teacher-sft.yaml")
    manifest = tmp_path / "manifests" / "gpu-distill.yaml"
    manifest.write_text(GPU_DISTILL)
    plan = plan_json(manifest, design=False)
    by_name = {p["name"]: p for p in plan["processes"]}
    teacher = by_name["teacher-0"]
    # inference fills node 0, the teacher takes 3 GPUs of node 1 (the rest idle), the trainer node 2
    assert {p["node"] for n, p in by_name.items() if n.startswith("inference")} == {0}
    assert (teacher["node"], teacher["gpus"]) == (1, [0, 1, 2]) and by_name["trainer"]["node"] == 2
    assert teacher["env"]["CUDA_VISIBLE_DEVICES"] == "0,1,2" and "VLLM_CPU_KVCACHE_SPACE" not in teacher["env"]
    argv = teacher["argv"]
    assert argv[argv.index("--tensor-parallel-size") + 1] == "3" and "--enforce-eager" not in argv
    assert by_name["orchestrator"]["config"]["teacher"]["url"] == f"http://{{host:1}}:{teacher['ports']['http']}/v1"
    memory = plan["memory"]["teacher"]
    assert memory["fits"] and memory["capacity_bytes"] == plan["memory"]["inference"]["capacity_bytes"]
    # the step's rollout side waits for the teacher's scoring of the batch, on its 3 GPUs
    loaded = load_manifest(manifest)
    _, facts = teacher_facts(loaded, facts_from_hf_config(*read_facts_json(loaded)))
    scoring = teacher_scoring_seconds(facts, rollouts_per_step=512, seq_len=64, gpus=3, gpu=gpu_spec("h200"))
    assert any("the teacher's scoring" in line for line in plan["estimates"]["summary"])
    times = plan["estimates"]["step"]
    assert times["teacher_seconds"] == pytest.approx(scoring) and scoring > 0
    assert times["rollout_seconds"] == pytest.approx(scoring + times["prefill_seconds"] + times["decode_seconds"])


def test_a_teacher_that_cannot_be_placed_or_served_is_refused_located(tmp_path):
    from conftest import plan_json

    _workspace(tmp_path, "reverse-text-teacher-sft.yaml")
    manifest = tmp_path / "manifests" / "gpu-distill.yaml"
    manifest.write_text(GPU_DISTILL)

    def field(*sets: str) -> set[str]:
        with pytest.raises(UserError) as err:
            plan_json(manifest, sets, design=False)
        return {p.field for p in err.value.problems}

    assert "distill.tp" in field("distill.tp=2")  # 3 KV heads: tp 2 splits them unevenly
    assert "distill.tp" in field("distill.tp=16")  # more GPUs than a node has
    with pytest.raises(UserError, match="remain after inference and the teacher"):  # no node left for the trainer
        plan_json(manifest, ["hardware.nodes=2"], design=False)
    assert "distill.tp" in field("inference.engine=embedded")  # tp 3: the embedded engine is one process
    assert "distill" in field("target={kind: kubernetes}")  # the pods' image has no teacher model


def test_teacher_with_another_tokenizer_is_refused_located(tmp_path):
    from primebuild.builders.plan import compile_plan
    from primebuild.manifest.load import load_manifest

    path = _workspace(tmp_path, "tool-use-sft.yaml")
    with pytest.raises(UserError) as err:
        compile_plan(load_manifest(path))
    (problem,) = err.value.problems
    assert problem.field == "distill.teacher.from_manifest" and problem.file == str(path) and problem.line
    assert "init:chat, vocabulary 104" in problem.message and "init:char, vocabulary 32" in problem.message


def test_slurm_gives_the_teacher_a_component_with_its_gpus(tmp_path):
    from primebuild.builders.plan import compile_plan
    from primebuild.builders.render import render
    from primebuild.contracts.render import RenderContext
    from primebuild.manifest.load import load_manifest

    _workspace(tmp_path, "reverse-text-teacher-sft.yaml")
    manifest = tmp_path / "manifests" / "gpu-distill.yaml"
    manifest.write_text(GPU_DISTILL)
    (script,) = render(compile_plan(load_manifest(manifest)), "slurm",
                       RenderContext(run_dir="/runs/x", python="/py")).values()
    headers = [line for line in script.splitlines() if line.startswith("#SBATCH --nodes=")]
    assert [h.split("--gres=")[1].split()[0] for h in headers] == ["gpu:8", "gpu:3", "gpu:8"]  # inference, teacher, trainer
    (step,) = [line for line in script.splitlines() if "--job-name=teacher-0" in line]
    assert "--het-group=1" in step and "--gres=gpu:3" in step
