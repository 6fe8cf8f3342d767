"""LoRA and FP8 training on the torchtitan engine: the same adapters, trajectory and published folders as on
the hf engine (peft's adapters, transformers' layers), and the same FP8 numerics."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import free_port, plan_json, run_cli
from safetensors.torch import load_file
from trainer_fixtures import make_tiny_model, run_trainers_in_one_launch, trainer_config, write_rollouts

from primebuild.errors import UserError
from primebuild.runtime.inference.engine import Engine
from primebuild.runtime.inference.sampling import SamplingParams
from primebuild.runtime.metrics import read_metrics
from primebuild.runtime.trainer.main import run_trainer
from primebuild.runtime.trainer.model import DistEnv, load_model
from primebuild.runtime.trainer.titan_policy import load_titan_model
from primebuild.runtime.weight_sync.filesystem import step_folder

ONE_RANK = DistEnv(0, 1, torch.device("cpu"))
LORA = {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]}
# fp32 on a CPU: the same operations in the same order on both engines; what is left is summation order
# inside different kernels (attention, the MoE's gather/scatter)
FP32 = 1e-5


# a MoE's routed experts are grouped weights, no linear modules, on either engine: attention only
MOE_LORA = {**LORA, "targets": ["q_proj", "k_proj", "o_proj"]}


def lora_config(lora=None):
    return trainer_config(model_path="m", run_dir="r", lora=lora or LORA).lora


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_adapters_are_peft_s_on_torchtitan_s_modules(tmp_path, moe):
    """Same adapted modules, same PEFT names, same initial values, only they train; with the same (random)
    adapter values both engines score the same log-probs."""
    path = make_tiny_model(tmp_path / "model", moe=moe, seed=7)
    lora = lora_config(MOE_LORA if moe else LORA)
    titan = load_titan_model(str(path), ONE_RANK, "float32", False, 16, lora=lora, seed=3)
    hf = load_model(str(path), ONE_RANK, "float32", False, 16, lora=lora, seed=3)
    ours, theirs = titan.adapter_parameters(), hf.adapter_parameters()
    assert [n for n, _ in ours] == [n for n, _ in theirs]
    assert len(ours) == 2 * 2 * len(lora.targets)  # A and B, 2 layers
    if moe:  # an MLP target adapts nothing on a MoE: refused, on both engines
        for load in (load_titan_model, load_model):
            with pytest.raises(UserError, match="down_proj"):
                load(str(path), ONE_RANK, "float32", False, 16, lora=lora_config())
    for (name, a), (_, b) in zip(ours, theirs, strict=True):
        assert torch.equal(a, b), name
    trainable = [n for n, p in titan.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(8), torch.arange(12)])[None].expand(2, -1)  # two documents a row
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for (_, a), (_, b) in zip(ours, theirs, strict=True):
            a.copy_(torch.randn(a.shape, generator=generator) * 0.1)
            b.copy_(a)
        lp_ours, _ = titan(ids, positions, 1.0)
        lp_theirs, _ = hf(ids, positions, 1.0)
        base, _ = load_titan_model(str(path), ONE_RANK, "float32", False, 16)(ids, positions, 1.0)
    assert (lp_ours - base).abs().max() > 1e-3  # the adapters change the function
    assert (lp_ours - lp_theirs)[positions > 0].abs().max() <= FP32


def _runs(tmp_path, model, names, steps=3):
    runs = {name: tmp_path / name for name in names}
    for run in runs.values():
        write_rollouts(run, model, range(1, steps + 1), num_prompts=5, group_size=3)
    return runs


def test_lora_trains_on_torchtitan_as_on_the_hf_engine_and_the_engine_serves_it(tmp_path):
    """Three steps on the same rollouts: the torchtitan engine's LoRA follows the hf engine's (fp32), both
    publish the same PEFT folder, and the embedded engine with it merged samples with the log-probs the
    torchtitan trainer computes for the same adapter."""
    model = make_tiny_model(tmp_path / "model")
    # eps 1e-4: AdamW moves a weight by ~lr * sign(g) where g is a rounding error of either engine's kernels;
    # above those gradients, weights move by ~lr * g / eps and the two engines' adapters compare
    common = dict(model_path=str(model), max_steps=3, lr=1e-2, eps=1e-4, micro_batch_tokens=48, loss="dppo-kl",
                  lora=LORA)
    runs = _runs(tmp_path, model, ("hf", "titan"))
    for engine, run in runs.items():
        run_trainer(trainer_config(run_dir=str(run), engine="hf" if engine == "hf" else "torchtitan", **common))
    metrics = {name: read_metrics(run / "metrics.jsonl") for name, run in runs.items()}
    for step in (1, 2, 3):
        for name in ("loss", "grad_norm", "behaviour_kl", "entropy"):
            assert metrics["titan"][step][name] == pytest.approx(metrics["hf"][step][name], rel=1e-4, abs=1e-6), \
                (step, name)
    assert metrics["titan"][3]["loss"] != metrics["titan"][1]["loss"]
    folders = {name: step_folder(run / "weights", 3) for name, run in runs.items()}
    assert {p.name for p in folders["titan"].iterdir()} == {"adapter_config.json", "adapter_model.safetensors", "STABLE"}
    assert (folders["titan"] / "adapter_config.json").read_text() == (folders["hf"] / "adapter_config.json").read_text()
    ours, theirs = (load_file(folders[n] / "adapter_model.safetensors") for n in ("titan", "hf"))
    assert ours.keys() == theirs.keys()
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in ours.items())  # B moved off 0
    for key, tensor in theirs.items():
        torch.testing.assert_close(ours[key], tensor, rtol=1e-4, atol=1e-6)

    # the trainer's log-probs, with the published adapter, of what the engine samples with it merged
    titan = load_titan_model(str(model), ONE_RANK, "float32", False, 16, lora=lora_config())
    with torch.no_grad():
        for name, param in titan.adapter_parameters():
            param.copy_(ours[name])
    engine = Engine(str(model), max_num_seqs=2, max_model_len=64)
    try:
        engine.update_weights(folders["titan"], version=3)
        prompt = [3, 17, 42, 5]
        out = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, seed=1))[0][0]
    finally:
        engine.shutdown()
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        lp, _ = titan(ids, torch.arange(ids.shape[1])[None], 1.0)
    assert torch.allclose(torch.tensor(out.logprobs), lp[0, len(prompt):], atol=1e-4)


def _fsdp_lora_case(_, folder):
    """test_two_fsdp_ranks_train_torchtitan_s_adapters_as_one_rank's runs: (common config, 2-rank config)."""
    model = make_tiny_model(folder / "model")
    # eps 1e-4: as above (a rounding-level gradient summed over 2 ranks, not 1, would flip AdamW's sign)
    common = dict(model_path=str(model), max_steps=3, lr=1e-2, eps=1e-4, micro_batch_tokens=48, loss="dppo-kl",
                  lora=LORA, engine="torchtitan")
    _runs(folder, model, ("one", "two"), steps=4)
    return common, trainer_config(run_dir=str(folder / "two"), checkpoint_every=3, parallel={"dp_shard": 2},
                                  activation_checkpointing=True, **common)


def _ep_case(switch, folder):
    """test_expert_parallel_ranks_train_as_one_rank_with_lora_or_fp8's runs: (common config, 2-rank config)."""
    model = make_tiny_model(folder / "model", moe=True)
    common = dict(model_path=str(model), max_steps=2, lr=1e-3, eps=1e-4, micro_batch_tokens=48, loss="dppo-kl",
                  engine="torchtitan", **EP_LAYOUTS[switch])
    _runs(folder, model, ("one", "two"), steps=2)
    return common, trainer_config(run_dir=str(folder / "two"), parallel={"dp_shard": 2, "ep": 2}, **common)


@pytest.fixture(scope="module")
def two_rank_runs(request, tmp_path_factory) -> dict:
    """(test, case) -> (its folder with one/ and two/, its common config, "ok" or why its 2-rank run failed) for
    every selected test below: their 2-rank runs one after the other in one torchrun launch
    (trainer_fixtures.run_trainers_in_one_launch: a launch's imports cost more than these few steps)."""
    built, configs = {}, {}
    for item in request.session.items:
        if item.module is request.module and item.originalname in TWO_RANK_CASES:
            case = next(iter(item.callspec.params.values())) if hasattr(item, "callspec") else None
            folder = tmp_path_factory.mktemp(f"{item.originalname[:20]}-{case}")
            common, two = TWO_RANK_CASES[item.originalname](case, folder)
            built[item.originalname, case] = folder, common
            configs[folder / "two.json"] = two
    verdicts = run_trainers_in_one_launch(configs, timeout=600) if configs else {}
    return {key: (folder, common, verdicts[folder / "two.json"]) for key, (folder, common) in built.items()}


@pytest.mark.slow
@pytest.mark.timeout(600)  # the module's 2-rank runs start with the first of these tests
def test_two_fsdp_ranks_train_torchtitan_s_adapters_as_one_rank(two_rank_runs):
    """Adapters added before FSDP wraps torchtitan's blocks (activation checkpointing too): 2 gloo ranks
    follow 1 rank, publish the same adapter, and their adapter-only checkpoint resumes on 1 rank."""
    folder, common, verdict = two_rank_runs["test_two_fsdp_ranks_train_torchtitan_s_adapters_as_one_rank", None]
    assert verdict == "ok", verdict
    runs = {name: folder / name for name in ("one", "two")}
    run_trainer(trainer_config(run_dir=str(runs["one"]), **common))
    one, two = (read_metrics(runs[n] / "metrics.jsonl") for n in ("one", "two"))
    for step in (1, 2, 3):
        for name in ("loss", "grad_norm", "behaviour_kl"):
            assert two[step][name] == pytest.approx(one[step][name], rel=1e-5, abs=1e-7), (step, name)
    a1, a2 = (load_file(step_folder(runs[n] / "weights", 3) / "adapter_model.safetensors") for n in ("one", "two"))
    assert a1.keys() == a2.keys()
    for key in a1:
        torch.testing.assert_close(a2[key], a1[key], rtol=1e-5, atol=1e-6)
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(step_folder(runs["two"] / "checkpoints", 3))).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)  # no frozen base
    for name in ("one", "two"):  # the 2-rank adapter checkpoint re-shards onto 1 rank
        run_trainer(trainer_config(run_dir=str(runs[name]), resume=True, **{**common, "max_steps": 4}))
    one, two = (read_metrics(runs[n] / "metrics.jsonl") for n in ("one", "two"))
    assert two[4]["loss"] == pytest.approx(one[4]["loss"], rel=1e-5, abs=1e-7)


# expert parallelism: torchtitan's token dispatcher, its experts sharded over EP then FSDP
EP_LAYOUTS = {"lora": dict(lora=MOE_LORA), "fp8": dict(precision="fp8")}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("switch", list(EP_LAYOUTS))
def test_expert_parallel_ranks_train_as_one_rank_with_lora_or_fp8(two_rank_runs, switch):
    """A Qwen3-MoE over 2 gloo ranks (ep 2, dp_shard 2) follows 1 rank: LoRA's adapters beside experts that
    EP shards, or FP8 experts fed by the all-to-all (tolerance as test_trainer_titan.py's EP layouts)."""
    folder, common, verdict = two_rank_runs["test_expert_parallel_ranks_train_as_one_rank_with_lora_or_fp8", switch]
    assert verdict == "ok", verdict
    runs = {name: folder / name for name in ("one", "two")}
    run_trainer(trainer_config(run_dir=str(runs["one"]), **common))
    one, two = (read_metrics(runs[n] / "metrics.jsonl") for n in ("one", "two"))
    for step in (1, 2):
        for name in ("loss", "grad_norm", "behaviour_kl", "entropy"):
            assert two[step][name] == pytest.approx(one[step][name], rel=1e-4, abs=1e-6), (step, name)
    if switch == "lora":
        a1, a2 = (load_file(step_folder(runs[n] / "weights", 2) / "adapter_model.safetensors") for n in ("one", "two"))
        assert a1.keys() == a2.keys() and all("self_attn" in k for k in a1)
        for key in a1:
            torch.testing.assert_close(a2[key], a1[key], rtol=1e-4, atol=2e-5)


TWO_RANK_CASES = {"test_two_fsdp_ranks_train_torchtitan_s_adapters_as_one_rank": _fsdp_lora_case,
                  "test_expert_parallel_ranks_train_as_one_rank_with_lora_or_fp8": _ep_case}


def make_fp8_aligned_moe(path: Path) -> Path:
    """A tiny Qwen3-MoE whose TP-split widths are multiples of 128 x 2 (q/o 4 x 64, k/v 4 x 64, experts 256),
    as the plan requires of FP8 under tp 2 (capabilities._fp8_tensor_parallel)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=96, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=4, head_dim=64, max_position_embeddings=256, tie_word_embeddings=True,
                            intermediate_size=256, moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


# FP8 rounds each 1 x 128 tile of an input: the row-split projections' partial sums, added in another order
# on 2 ranks, move an input by an ulp of fp32, which now and then crosses an e4m3 rounding boundary; the
# gradients downstream of such a flip (the last layer's experts most) move by up to 2e-3 (measured 1.9e-3)
TP_FP8_GRADIENTS = 1e-2


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("switch", ["lora", "fp8"])
def test_tensor_parallel_moe_with_lora_or_fp8_gradients_equal_one_rank(tmp_path, switch):
    """tp 2 on a Qwen3-MoE (experts TP-split): LoRA's adapters split as their base weight (column-split:
    B's rows; row-split: A's columns), their gradients and the published adapters one rank's; FP8 linears
    multiply their own shards, whose 128-blocks are the whole weight's on an aligned model."""
    from titan_grads_worker import loss_of, random_adapters, switches, whole_gradients

    from primebuild.runtime.trainer.lora import adapter_tensors

    model = make_fp8_aligned_moe(tmp_path / "model") if switch == "fp8" else make_tiny_model(tmp_path / "model", moe=True, seed=3)
    out = tmp_path / "tp2.pt"
    worker = Path(__file__).with_name("titan_grads_worker.py")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           f"--master_port={free_port()}", str(worker), str(model), str(out), switch],
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    two = torch.load(out)
    policy = load_titan_model(str(model), ONE_RANK, "float32", False, 16, **switches(switch))
    if switch == "lora":
        random_adapters(policy)
    loss = loss_of(policy, policy.config.vocab_size)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_([p for p in policy.parameters() if p.grad is not None], 1e9)
    one = whole_gradients(policy)
    assert two["grads"].keys() == one.keys()
    assert two["loss"].item() == pytest.approx(loss.item(), rel=1e-6)
    assert two["grad_norm"].item() == pytest.approx(norm.item(), rel=1e-5)
    off = {name: ((two["grads"][name] - g).norm() / g.norm()).item() for name, g in one.items()}
    worst = sorted(off.items(), key=lambda kv: -kv[1])[:3]
    if switch == "lora":
        assert len(one) == 2 * 2 * 3 and max(off.values()) < 1e-5, worst  # A and B of 3 targets, 2 layers
        published = adapter_tensors(policy.adapter_parameters())
        assert two["adapters"].keys() == published.keys()
        for name, tensor in published.items():
            assert torch.equal(two["adapters"][name], tensor), name
    else:
        assert any(".routed_experts." in name for name in one) and max(off.values()) < TP_FP8_GRADIENTS, worst


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fp8_under_tensor_parallelism_refuses_a_model_whose_blocks_would_straddle_ranks(tmp_path):
    """A hand-written config meets the plan's 128 x tp rule at load (titan_fp8.check_tp_blocks_whole): the
    tiny MoE's q width 64 cannot be split into whole 128-blocks over 2 ranks."""
    model = make_tiny_model(tmp_path / "model", moe=True, seed=3)
    worker = Path(__file__).with_name("titan_grads_worker.py")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           f"--master_port={free_port()}", str(worker), str(model), str(tmp_path / "out.pt"), "fp8"],
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0 and not (tmp_path / "out.pt").exists()
    assert "precision fp8 under tp=2: layers.0.attention.qkv_linear.wq.weight splits a dimension of 64" in proc.stderr


def test_fp8_under_tensor_parallelism_is_planned_where_its_blocks_stay_whole():
    """The plan takes FP8 with tp > 1 where every TP-split width is a multiple of 128 x tp (as the aligned
    model above), and refuses it, located at trainer.tp, where a block would straddle two ranks."""
    def config(plan):
        return next(p for p in plan["processes"] if p["name"].split("-")[0] == "trainer")["config"]

    big = "manifests/qwen3-30b-a3b.yaml"  # q/o 4096, k/v 512, experts 768 wide
    for sets in (["trainer.dp_shard=4", "trainer.tp=2"], ["trainer.dp_shard=2", "trainer.tp=4", "trainer.ep=8"]):
        plan = plan_json(big, [*sets, "trainer.precision=fp8"])  # a design study: its taskset is not installed
        assert not [u for u in plan["unsupported"] if u["field"].startswith("trainer.")], sets
        assert config(plan)["engine"] == "torchtitan" and config(plan)["precision"] == "fp8", sets
    with pytest.raises(UserError) as err:  # tp 4 splits each expert: 768 / 4 = 192 columns, not 128-blocks
        plan_json(big, ["trainer.dp_shard=2", "trainer.tp=4", "trainer.ep=1", "trainer.precision=fp8"], design=False)
    (problem,) = [p for p in err.value.problems if p.field == "trainer.tp"]
    assert "routed experts' width (moe_intermediate_size) 768" in problem.message and "ep >= 2" in problem.hint
    refused = run_cli("plan", "manifests/reverse-text-moe.yaml", "--set", "trainer.dp_shard=1", "--set", "trainer.tp=2",
                      "--set", "trainer.ranks=2", "--set", "trainer.precision=fp8")
    assert refused.code == 2 and "Traceback" not in refused.err
    assert "trainer.tp" in refused.err and "q/o projection width (heads x head_dim) 128" in refused.err


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_fp8_on_torchtitan_computes_as_fp8_on_the_hf_engine(tmp_path, moe):
    """FP8 forwards on torchtitan's linears and experts: the hf engine's log-probs and gradients (same
    quantisation, same order: equal to fp32 tolerance on a CPU), and far from the fp32 model's, so FP8 ran."""
    path = make_tiny_model(tmp_path / "model", moe=moe, seed=8)
    titan = load_titan_model(str(path), ONE_RANK, "float32", False, 16, fp8=True)
    hf = load_model(str(path), ONE_RANK, "float32", False, 16, fp8=True)
    kinds = {type(m).__name__ for m in titan.modules()}
    assert "Fp8TitanLinear" in kinds and ("Fp8GroupedExperts" in kinds) == moe
    assert all(type(m.gate).__name__ == "Linear" for m in titan.modules() if hasattr(m, "gate"))  # routers stay
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(24)[None].expand(2, -1)
    ours, _ = titan(ids, positions, 1.0)
    theirs, _ = hf(ids, positions, 1.0)
    with torch.no_grad():
        exact, _ = load_titan_model(str(path), ONE_RANK, "float32", False, 16)(ids, positions, 1.0)
    assert (ours - theirs)[:, 1:].abs().max() <= FP32
    assert (ours - exact)[:, 1:].abs().max() > 1e-3
    ours.sum().backward()
    theirs.sum().backward()
    ours_grads = titan.to_checkpoint_naming({n: p.grad for n, p in titan.titan.named_parameters()})
    theirs_grads = {n.removeprefix("hf."): p.grad for n, p in hf.named_parameters()}
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight"):
        torch.testing.assert_close(ours_grads[name], theirs_grads[name], rtol=1e-4, atol=FP32)


def test_fp8_trains_on_torchtitan_as_on_the_hf_engine(tmp_path):
    model = make_tiny_model(tmp_path / "model")
    common = dict(model_path=str(model), max_steps=2, lr=1e-3, micro_batch_tokens=48, loss="dppo-kl",
                  precision="fp8")
    runs = _runs(tmp_path, model, ("hf", "titan"))
    for engine, run in runs.items():
        run_trainer(trainer_config(run_dir=str(run), engine="hf" if engine == "hf" else "torchtitan", **common))
    metrics = {name: read_metrics(run / "metrics.jsonl") for name, run in runs.items()}
    for step in (1, 2):
        for name in ("loss", "grad_norm", "behaviour_kl", "entropy"):
            assert metrics["titan"][step][name] == pytest.approx(metrics["hf"][step][name], rel=1e-4, abs=1e-6), \
                (step, name)
