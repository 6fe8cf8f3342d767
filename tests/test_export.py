"""`primebuild export`: a run's checkpoint becomes a Hugging Face folder in the store that scores as the
trainer's policy, that a manifest starts from, and that bad input leaves untouched.

One real run of the embedded default (broadcast weight sync: it leaves DCP checkpoints only) is shared with
tests/test_vllm_export.py (conftest `broadcast_checkpoint_run`), where the session's vLLM server serves the
export: that test alone joins the serial `vllm` group, and this module runs beside it. The 2-rank and LoRA
checkpoints come from the trainer alone on synthetic rollouts, as the trainer's own tests make them.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from conftest import call_cli, free_port, run_cli
from safetensors.torch import load_file
from trainer_fixtures import make_tiny_model, run_trainers_in_one_launch, trainer_config, write_rollouts

from primebuild.builders.export import trainer_config as run_trainer_config
from primebuild.runtime.rollout_file import load_batch
from primebuild.runtime.trainer.checkpoint import load_checkpoint
from primebuild.runtime.trainer.main import run_trainer
from primebuild.runtime.trainer.model import DistEnv, load_model
from primebuild.runtime.weight_sync.filesystem import step_folder

pytestmark = pytest.mark.timeout(300)
ONE_RANK = DistEnv(0, 1, torch.device("cpu"))
SMALL_RL = ["--set", "orchestrator.rollouts_per_step=32", "--set", "orchestrator.eval_prompts=40"]
LORA = {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj", "down_proj"]}


@pytest.fixture(scope="module")
def run_dir(broadcast_checkpoint_run: Path) -> Path:
    """Two steps in broadcast mode, a checkpoint after each (conftest: one run for the session)."""
    return broadcast_checkpoint_run


@pytest.fixture(scope="module")
def workspace(run_dir: Path) -> Path:
    """The run's manifests/ and store/: this module's exports go into that store."""
    return run_dir.parent.parent


def _env(workspace: Path) -> dict:
    return {"PRIMEBUILD_STORE": str(workspace / "store")}


def _run(workspace: Path, manifest: Path, runs: Path, *sets: str) -> Path:
    result = run_cli("run", manifest, "--runs-dir", runs, "--quiet", *SMALL_RL, "--set",
                     f"inference.port={free_port()}", *sets, env=_env(workspace), timeout=280)
    assert result.code == 0, result.text[-3000:]
    (run_dir,) = [p for p in runs.iterdir() if p.is_dir()]
    return run_dir


def _export(workspace: Path, *args) -> Path:
    result = run_cli("export", *args, env=_env(workspace), timeout=200)
    assert result.code == 0, result.text[-3000:]
    path = Path(result.out.strip().splitlines()[-1])
    assert path.parent == workspace / "store" and path.is_dir()
    return path


def _trainer_policy(run: Path, step: int):
    """The trainer's policy at `step`, as the trainer builds it and resumes it (model and optimizer)."""
    from primebuild.contracts.run_dir import RunDir

    config, _ = run_trainer_config(RunDir(run))
    if config.engine == "torchtitan":
        from primebuild.runtime.trainer.titan_policy import load_titan_model

        policy = load_titan_model(config.model_path, ONE_RANK, "float32", False, config.logprob_chunk_tokens)
    else:
        policy = load_model(config.model_path, ONE_RANK, "float32", False, config.logprob_chunk_tokens,
                            lora=config.lora, seed=config.seed)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad])
    assert load_checkpoint(step_folder(run / "checkpoints", step), policy, optimizer) == step
    return policy.eval()


def _hf_logprobs(folder: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def _policy_logprobs(policy, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        lp, _ = policy(torch.tensor([ids]), torch.arange(len(ids))[None], 1.0)
    return lp[0, 1:]


def test_the_export_scores_as_the_trainer_at_that_step(workspace: Path, run_dir: Path):
    """fp32: the exported folder, loaded by transformers, gives the trainer's log-probs at step 1 (not the
    newest) within 1e-5 on the run's own rollouts; the newest step is the default and another entry."""
    first = _export(workspace, run_dir, "--step", "1")
    newest = _export(workspace, run_dir)
    assert first != newest and first.name.endswith("-step1") and newest.name.endswith("-step2")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= \
        {p.name for p in first.iterdir()}
    assert json.loads((first / "config.json").read_text())["dtype"] == "float32"
    policy = _trainer_policy(run_dir, 1)
    samples = load_batch(run_dir / "rollouts" / "step_000002.safetensors").samples[:6]
    worst = 0.0
    for sample in samples:
        ids = sample.prompt_ids + sample.completion_ids
        worst = max(worst, (_hf_logprobs(first, ids) - _policy_logprobs(policy, ids)).abs().max().item())
    assert worst <= 1e-5, worst
    # the two steps' policies differ: the comparison above is not between two copies of the base model
    ids = samples[0].prompt_ids + samples[0].completion_ids
    assert (_hf_logprobs(first, ids) - _hf_logprobs(newest, ids)).abs().max().item() > 1e-6
    # exporting again is a cache hit on the same entry
    again = run_cli("export", run_dir, "--step", "1", "-o", "json", env=_env(workspace), timeout=200)
    assert again.code == 0 and json.loads(again.out) == {"path": str(first), "run_dir": str(run_dir), "step": 1,
                                                         "adapter": False, "cache_hit": True}


def test_a_manifest_starts_from_the_run_and_the_embedded_engine_serves_it(workspace: Path, run_dir: Path):
    """`model: {from_run: RUN_DIR, step: 2}`: lock and plan read the export, the run's processes load the
    store entry `export` makes, and at step 1 the server's sampling log-probs are the trainer's."""
    manifests = workspace / "manifests"
    doc = yaml.safe_load((manifests / "reverse-text.yaml").read_text())
    doc["name"] = "from-run"
    doc["model"] = {"from_run": os.path.relpath(run_dir, manifests), "step": 2, "dtype": "float32"}
    manifest = manifests / "from-run.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    exported = _export(workspace, run_dir, "--step", "2")
    plan = run_cli("plan", manifest, "-o", "json", env=_env(workspace))
    assert plan.code == 0, plan.text
    assert json.loads(plan.out)["model"]["source"] == "from_run" and json.loads(plan.out)["model"]["step"] == 2
    run = _run(workspace, manifest, workspace / "runs-from-run", "--set", "orchestrator.max_steps=1",
               "--set", "orchestrator.max_off_policy_steps=0")
    assert json.loads((run / "rendezvous.json").read_text())["model_path"] == str(exported)
    step1 = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    mismatch = [r["value"] for r in step1 if r["name"] == "mismatch_kl" and r["step"] == 1 and r["role"] == "trainer"]
    assert mismatch and mismatch[0] < 1e-6, mismatch


def _tree(path: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(path)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in sorted(path.rglob("*"))}


def test_bad_input_changes_nothing_and_names_what_and_where(workspace: Path, run_dir: Path, tmp_path: Path,
                                                            capsys):
    store = workspace / "store"
    before = (_tree(store), _tree(run_dir))

    def refused(*args) -> str:
        result = call_cli(capsys, "export", *args, "--store", store)
        assert result.code == 2, result.text
        assert "Traceback" not in result.text
        assert (_tree(store), _tree(run_dir)) == before
        return result.err

    assert f"{workspace / 'manifests'} is not a run folder" in refused(workspace / "manifests")
    assert "no such folder" in refused(tmp_path / "nowhere")
    err = refused(run_dir, "--step", "7")
    assert f"{run_dir / 'checkpoints' / 'step_000007'}: no complete checkpoint of step 7" in err
    assert "complete checkpoints: 1, 2" in err
    # a damaged checkpoint (one byte of a shard flipped, in a copy of the run) is named, file and all
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    shard = sorted((copy / "checkpoints" / "step_000002").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    before = (_tree(store), _tree(run_dir))
    err = refused(copy, "--step", "2")
    assert f"{shard.parent}: {shard.name}: sha256 differs" in err

    # an entry that already exists under the key with other content: refused, named, left as it is (a
    # store of this test's own, so that the other tests' entries stay intact)
    store = tmp_path / "store"
    made = run_cli("export", run_dir, "--step", "1", "--store", store, timeout=200)
    assert made.code == 0, made.text[-3000:]
    entry = Path(made.out.strip())
    os.chmod(entry, 0o755)
    os.chmod(entry / "config.json", 0o644)
    (entry / "config.json").write_text("{}")
    before = (_tree(store), _tree(run_dir))
    err = refused(run_dir, "--step", "1")
    assert f"store entry {entry} was modified after it was built" in err and "config.json (content changed" in err


TWO_RANK_LAYOUTS = ["fsdp2-hf", "ep2-moe-torchtitan"]


@pytest.fixture(scope="module")
def two_rank_runs(request, tmp_path_factory) -> dict:
    """layout -> (its folder, its trainer config, "ok" or why the run failed) for every selected layout of
    the test below: 2 ranks train 2 steps, checkpoint and publish step 2, the layouts one after the other in
    one torchrun launch (trainer_fixtures.run_trainers_in_one_launch: a launch's imports cost more than the
    steps)."""
    layouts = [item.callspec.params["layout"] for item in request.session.items
               if item.module is request.module and item.originalname == "test_a_two_rank_checkpoint_exports_as_the_weights_the_ranks_published"]
    built, configs = {}, {}
    for layout in layouts:
        folder = tmp_path_factory.mktemp(layout)
        moe = layout.startswith("ep2")
        model = make_tiny_model(folder / "model", moe=moe, seed=3)
        write_rollouts(folder / "run", model, range(1, 3), num_prompts=4, group_size=3)
        parallel = {"dp_shard": 2, "ep": 2} if moe else {"dp_shard": 2}
        configs[folder / "trainer.json"] = built[layout] = trainer_config(
            model_path=str(model), run_dir=str(folder / "run"), max_steps=2, checkpoint_every=2,
            micro_batch_tokens=48, loss="dppo-kl", parallel=parallel, engine="torchtitan" if moe else "hf")
    verdicts = run_trainers_in_one_launch(configs, timeout=480) if configs else {}
    return {layout: (folder.parent, config, verdicts[folder])
            for (layout, config), folder in zip(built.items(), configs, strict=True)}


@pytest.mark.slow
@pytest.mark.timeout(600)  # the module's 2-rank runs start with the first of these tests
@pytest.mark.parametrize("layout", TWO_RANK_LAYOUTS)
def test_a_two_rank_checkpoint_exports_as_the_weights_the_ranks_published(two_rank_runs, layout: str):
    """2 ranks (FSDP2 on the hf engine; FSDP + EP 2 on torchtitan's MoE) checkpoint and publish step 2;
    the export of that checkpoint, read by one process and cut into shards, holds exactly the tensors the
    ranks published, and transformers loads the sharded folder."""
    from primebuild.runtime.export import write_export

    tmp_path, config, verdict = two_rank_runs[layout]
    assert verdict == "ok", verdict
    model, run = tmp_path / "model", tmp_path / "run"
    checkpoint = step_folder(run / "checkpoints", 2)
    assert len(list(checkpoint.glob("*.distcp"))) == 2  # one shard file per rank
    out = tmp_path / "export"
    out.mkdir()
    written = write_export(config, checkpoint, out, adapter=False, max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(written["files"]) > 1 and set(index["weight_map"].values()) == set(written["files"])
    exported = {k: v for f in written["files"] for k, v in load_file(out / f).items()}
    published = load_file(step_folder(run / "weights", 2) / "model.safetensors")
    assert exported.keys() == published.keys()
    for name, tensor in published.items():
        assert torch.equal(exported[name], tensor), name
    base = load_file(model / "model.safetensors")
    assert any(not torch.equal(base[k], published[k]) for k in base)  # the run trained
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert torch.equal(loaded.state_dict()["model.norm.weight"], published["model.norm.weight"])


@pytest.mark.parametrize("engine", ["hf", "torchtitan"])
def test_lora_exports_merged_by_default_and_as_the_adapter_on_request(tmp_path: Path, engine: str):
    """A LoRA checkpoint holds the adapters only: merged, the folder scores as the trainer's adapted policy
    (fp32, 1e-5); as an adapter, it is the PEFT folder the run published at that step. Both engines: peft's
    layers on transformers', LoraLinear on torchtitan's (titan_lora.py)."""
    from primebuild.runtime.export import write_export

    model = make_tiny_model(tmp_path / "model", seed=4)
    run = tmp_path / "run"
    write_rollouts(run, model, range(1, 3))
    config = trainer_config(model_path=str(model), run_dir=str(run), max_steps=2, checkpoint_every=2, lr=1e-2,
                            micro_batch_tokens=64, loss="dppo-kl", lora=LORA, engine=engine)
    run_trainer(config)
    checkpoint = step_folder(run / "checkpoints", 2)
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    merged.mkdir()
    adapter.mkdir()
    assert write_export(config, checkpoint, merged, adapter=False, max_shard_bytes=10**9)["form"] == "merged"
    assert write_export(config, checkpoint, adapter, adapter=True, max_shard_bytes=10**9)["form"] == "adapter"
    assert not any("lora" in k for k in load_file(merged / "model.safetensors"))
    policy = _lora_policy(config, checkpoint)
    ids = [3, 17, 42, 5, 9, 11, 60, 2]
    worst = (_hf_logprobs(merged, ids) - _policy_logprobs(policy, ids)).abs().max().item()
    base = (_hf_logprobs(model, ids) - _policy_logprobs(policy, ids)).abs().max().item()
    assert worst <= 1e-5 < base, (worst, base)  # and the adapters moved the policy off the base
    published = load_file(step_folder(run / "weights", 2) / "adapter_model.safetensors")
    ours = load_file(adapter / "adapter_model.safetensors")
    assert ours.keys() == published.keys() and all(torch.equal(ours[k], published[k]) for k in published)


def _lora_policy(config, checkpoint: Path):
    """The trainer's adapted policy as resume restores it (model and optimizer state)."""
    if config.engine == "torchtitan":
        from primebuild.runtime.trainer.titan_policy import load_titan_model

        policy = load_titan_model(config.model_path, ONE_RANK, "float32", False, config.logprob_chunk_tokens,
                                  lora=config.lora, seed=config.seed)
    else:
        policy = load_model(config.model_path, ONE_RANK, "float32", False, config.logprob_chunk_tokens,
                            lora=config.lora, seed=config.seed)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad])
    load_checkpoint(checkpoint, policy, optimizer)
    return policy.eval()
