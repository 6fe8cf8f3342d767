"""LoRA RL (trainer.lora): the trainer trains peft adapters only, publishes a PEFT adapter folder per step,
checkpoints and resumes them; the embedded engine merges the adapter and scores what the trainer scores;
the plan validates targets, refuses what the LoRA path does not cover and counts adapters in memory."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from trainer_fixtures import make_tiny_model, run_trainer_ranks, trainer_config, write_rollouts
from transformers import AutoModelForCausalLM

from primebuild.runtime.inference.engine import Engine
from primebuild.runtime.inference.lora import AdapterMerger
from primebuild.runtime.inference.sampling import SamplingParams
from primebuild.runtime.metrics import read_metrics
from primebuild.runtime.trainer.main import run_trainer
from primebuild.runtime.trainer.model import DistEnv, load_model
from primebuild.runtime.weight_sync.filesystem import stable_steps, step_folder

LORA = {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj", "down_proj"]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    model = make_tiny_model(root / "model")
    rollouts = root / "rollouts_src"
    write_rollouts(rollouts, model, range(1, 5))
    return model, rollouts / "rollouts"


def new_run(tmp_path, tiny, name="run", **overrides):
    model, rollouts = tiny
    run = tmp_path / name
    (run / "rollouts").mkdir(parents=True)
    for f in rollouts.iterdir():
        (run / "rollouts" / f.name).write_bytes(f.read_bytes())
    cfg = dict(model_path=str(model), run_dir=str(run), max_steps=3, lr=1e-2, micro_batch_tokens=64, loss="dppo-kl",
               lora=LORA)
    cfg.update(overrides)
    return trainer_config(**cfg)


def test_only_adapters_train_and_start_as_the_base(tiny):
    model_path, _ = tiny
    env = DistEnv(0, 1, torch.device("cpu"))
    policy = load_model(str(model_path), env, "float32", False, 16, lora=trainer_config(
        model_path="m", run_dir="r", lora=LORA).lora)
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 3 * 2  # A and B, 3 targets, 2 layers
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ids = torch.tensor([[3, 17, 42, 5, 9]])
    with torch.no_grad():
        ours, _ = policy(ids, torch.arange(ids.shape[1])[None], 1.0)
        ref = torch.log_softmax(base(input_ids=ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    assert torch.allclose(ours[0, 1:], ref, atol=1e-5)  # B = 0: the adapted model is the base model


def test_publishes_adapter_folders_that_the_embedded_engine_merges(tmp_path, tiny):
    cfg = new_run(tmp_path, tiny, max_steps=2)
    run_trainer(cfg)
    m = read_metrics(Path(cfg.run_dir) / "metrics.jsonl")
    assert m[1]["mismatch_kl"] < 1e-6 and m[1]["grad_norm"] > 0
    folder = step_folder(Path(cfg.run_dir) / "weights", 2)
    assert {p.name for p in folder.iterdir()} == {"adapter_config.json", "adapter_model.safetensors", "STABLE"}
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 8.0, sorted(LORA["targets"]))
    adapter = load_file(folder / "adapter_model.safetensors")
    assert all(k.startswith("base_model.model.model.layers.") for k in adapter)
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in adapter.items())  # B moved off 0
    full = sum(p.stat().st_size for p in Path(cfg.model_path).glob("*.safetensors"))
    assert (folder / "adapter_model.safetensors").stat().st_size < full / 4

    # The engine serves W0 + alpha/r * B A; its log-probs match an HF model with the adapter merged by peft.
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(cfg.model_path, dtype=torch.float32)
    merged_hf = PeftModel.from_pretrained(base, folder).merge_and_unload().eval()
    engine = Engine(cfg.model_path, max_num_seqs=2, max_model_len=64)
    try:
        engine.update_weights(folder, version=2)
        prompt = [3, 17, 42, 5]
        out = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=1))[0][0]
        ids = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            lp = torch.log_softmax(merged_hf(input_ids=ids).logits[0, len(prompt) - 1:-1], -1)
        ref = lp.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
        assert engine.version == 2
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-4)
    finally:
        engine.shutdown()


def test_merge_goes_back_to_the_base_every_time(tmp_path, tiny):
    cfg = new_run(tmp_path, tiny, max_steps=2)
    run_trainer(cfg)
    merger = AdapterMerger(cfg.model_path)
    one = merger.merged(step_folder(Path(cfg.run_dir) / "weights", 1))
    merger.merged(step_folder(Path(cfg.run_dir) / "weights", 2))
    again = merger.merged(step_folder(Path(cfg.run_dir) / "weights", 1))
    assert all(torch.equal(one[k], again[k]) for k in one)  # never merged into an earlier merge


def test_checkpoint_holds_adapters_and_resume_continues_identically(tmp_path, tiny):
    straight = new_run(tmp_path, tiny, "straight", max_steps=4, checkpoint_every=0)
    run_trainer(straight)
    first = new_run(tmp_path, tiny, "resumed", max_steps=2, checkpoint_every=1, keep_checkpoints=1)
    run_trainer(first)
    ckpt = Path(first.run_dir) / "checkpoints"
    assert stable_steps(ckpt) == [2]
    size = sum(p.stat().st_size for p in step_folder(ckpt, 2).iterdir())
    full = sum(p.stat().st_size for p in Path(first.model_path).glob("*.safetensors"))
    assert size < full  # adapters and their AdamW moments, not the frozen base
    run_trainer(first.model_copy(update={"max_steps": 4, "resume": True}))
    a = read_metrics(Path(straight.run_dir) / "metrics.jsonl")
    b = read_metrics(Path(first.run_dir) / "metrics.jsonl")
    for step in (3, 4):
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-9, abs=1e-12), step
    wa = load_file(step_folder(Path(straight.run_dir) / "weights", 4) / "adapter_model.safetensors")
    wb = load_file(step_folder(Path(first.run_dir) / "weights", 4) / "adapter_model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_fsdp_ranks_train_the_adapters_one_rank_does(tmp_path):
    """Adapters injected before FSDP wraps the blocks: 2 ranks (gloo) match 1 rank, and their 2-rank
    adapter-only checkpoint resumes on 1 rank."""


    model = make_tiny_model(tmp_path / "model")
    # eps 1e-4: where an adapter's gradient is a rounding error, summing it over 2 ranks instead of 1 can flip
    # the sign of AdamW's first steps (~lr * sign(g)); above those gradients the two runs compare (as in
    # test_trainer_titan.py)
    common = dict(model_path=str(model), max_steps=3, lr=1e-2, eps=1e-4, micro_batch_tokens=48, loss="dppo-kl",
                  lora=LORA)
    runs = {name: tmp_path / name for name in ("one", "two")}
    for run in runs.values():
        write_rollouts(run, model, range(1, 5), num_prompts=5, group_size=3)
    run_trainer(trainer_config(run_dir=str(runs["one"]), **common))
    run_trainer_ranks(trainer_config(run_dir=str(runs["two"]), checkpoint_every=3, parallel={"dp_shard": 2},
                                     **common), tmp_path / "two.json")
    one, two = (read_metrics(runs[n] / "metrics.jsonl") for n in ("one", "two"))
    for step in (1, 2, 3):
        for name in ("loss", "grad_norm", "behaviour_kl"):
            assert two[step][name] == pytest.approx(one[step][name], rel=1e-5, abs=1e-7), (step, name)
    a1 = load_file(step_folder(runs["one"] / "weights", 3) / "adapter_model.safetensors")
    a2 = load_file(step_folder(runs["two"] / "weights", 3) / "adapter_model.safetensors")
    assert a1.keys() == a2.keys() and any(v.abs().sum() > 0 for k, v in a1.items() if "lora_B" in k)
    for k in a1:
        torch.testing.assert_close(a2[k], a1[k], rtol=1e-5, atol=1e-6)
    for name in ("one", "two"):  # the sharded adapter checkpoint re-shards onto 1 rank
        run_trainer(trainer_config(run_dir=str(runs[name]), resume=True, **{**common, "max_steps": 4}))
    one, two = (read_metrics(runs[n] / "metrics.jsonl") for n in ("one", "two"))
    assert two[4]["loss"] == pytest.approx(one[4]["loss"], rel=1e-5, abs=1e-7)
