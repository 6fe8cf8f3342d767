"""The torchtitan engine: torchtitan's Qwen3 modules score, train and publish as transformers' model does."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import free_port, plan_json, run_cli
from safetensors.torch import load_file
from trainer_fixtures import (
    attach_routes,
    make_batch,
    make_tiny_model,
    run_trainers_in_one_launch,
    trainer_config,
    write_rollouts,
)

from primebuild.errors import UserError
from primebuild.runtime.metrics import read_metrics
from primebuild.runtime.trainer.batch import pack
from primebuild.runtime.trainer.main import run_trainer
from primebuild.runtime.trainer.model import DistEnv, load_model
from primebuild.runtime.trainer.titan_policy import TitanPolicy, load_titan_model
from primebuild.runtime.weight_sync.filesystem import step_folder

ONE_RANK = DistEnv(0, 1, torch.device("cpu"))
# fp32 MoE: torchtitan's experts in fp32 (titan_model.ExactGroupedExperts) vs transformers' own loop
MOE_FP32_TOLERANCE = 1e-5


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_logprobs_equal_transformers_on_the_same_weights(tmp_path, moe):
    path = make_tiny_model(tmp_path / "model", moe=moe, seed=5)
    titan = load_titan_model(str(path), ONE_RANK, "float32", False, 16)
    assert isinstance(titan, TitanPolicy) and type(titan.titan).__module__.startswith("torchtitan.")
    hf = load_model(str(path), ONE_RANK, "float32", False, 16)
    from transformers import AutoModelForCausalLM

    samples = make_batch(AutoModelForCausalLM.from_pretrained(path), step=1, num_prompts=4, group_size=4).samples
    (mbs,) = pack(samples, micro_batch_tokens=64, world_size=1)
    worst = 0.0
    for mb in mbs:
        with torch.no_grad():
            ours, ours_entropy = titan(mb.input_ids, mb.position_ids, 1.0)
            theirs, theirs_entropy = hf(mb.input_ids, mb.position_ids, 1.0)
        scored = mb.position_ids > 0  # every prediction inside a document
        worst = max(worst, (ours - theirs)[scored].abs().max().item(),
                    (ours_entropy - theirs_entropy)[scored].abs().max().item())
    assert worst <= (MOE_FP32_TOLERANCE if moe else 1e-5), worst


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_published_weights_are_the_checkpoint_in_its_own_naming(tmp_path, moe):
    path = make_tiny_model(tmp_path / "model", moe=moe, seed=6)
    titan = load_titan_model(str(path), ONE_RANK, "float32", True, 16)
    published = dict(t for group in titan.published_weights(torch.float32).groups() for t in group)
    checkpoint = load_file(path / "model.safetensors")
    # the tied head under its own name too (weight_stream.py: vLLM reloads it only from its own key)
    assert published.keys() == checkpoint.keys() | {"lm_head.weight"}
    for name, tensor in checkpoint.items():
        assert torch.equal(published[name], tensor), name
    assert torch.equal(published["lm_head.weight"], checkpoint["model.embed_tokens.weight"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tensor_parallel_moe_gradients_equal_one_rank(tmp_path):
    """torchtitan's TP plan for a MoE (each expert's hidden dimension split over 2 ranks, the router
    replicated, sequence parallel around the block): the loss, every parameter's gradient and the trainer's
    gradient norm equal one rank's on the same weights and batch (fp32). Without
    titan_parallelize.keep_expert_input_gradients the experts' share of the MoE input's gradient is lost
    (measured: ffn_norm's gradient 98% off, every parameter below the last MoE ~4%, the norm 0.2%)."""
    from titan_grads_worker import loss_of, whole_gradients

    model = make_tiny_model(tmp_path / "model", moe=True, seed=3)
    out = tmp_path / "tp2.pt"
    worker = Path(__file__).with_name("titan_grads_worker.py")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           f"--master_port={free_port()}", str(worker), str(model), str(out)],
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    two = torch.load(out)
    policy = load_titan_model(str(model), ONE_RANK, "float32", False, 16)
    loss = loss_of(policy, policy.config.vocab_size)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), 1e9)  # what main._grad_norm does on one rank
    one = whole_gradients(policy)
    assert two["loss"].item() == pytest.approx(loss.item(), rel=1e-6)
    assert two["grads"].keys() == one.keys() and any(".moe.routed_experts." in name for name in one)
    off = {name: ((two["grads"][name] - g).norm() / g.norm()).item() for name, g in one.items()}
    assert max(off.values()) < 1e-5, sorted(off.items(), key=lambda kv: -kv[1])[:3]
    assert two["grad_norm"].item() == pytest.approx(norm.item(), rel=1e-5)


# 2 ranks (4 where the layout says so), each layout through torchtitan's meshes (titan_parallelize.py)
LAYOUTS = {
    "fsdp2-ac": dict(moe=False, parallel={"dp_shard": 2}, activation_checkpointing=True),
    "hsdp": dict(moe=False, parallel={"dp_replicate": 2}),
    "ep2-ac": dict(moe=True, parallel={"dp_shard": 2, "ep": 2}, activation_checkpointing=True),
    # routes replayed at torchtitan's routers, before its token dispatcher: every 4th position's experts
    # differ from the router's own choice (trainer_fixtures.attach_routes)
    "ep2-replay": dict(moe=True, parallel={"dp_shard": 2, "ep": 2}, router_replay=True),
    # each packed row split head-and-tail over 2 ranks (4 chunks of a 48-token row of several documents:
    # documents cross the split), k/v gathered (titan_model.DocumentAttention with a ContextShard)
    "cp2": dict(moe=False, parallel={"dp_shard": 1, "cp": 2}),
    # torchtitan's Qwen3 TP plan (heads and MLP columns split, sequence parallel between them)
    "tp2": dict(moe=False, parallel={"dp_shard": 1, "tp": 2}),
    # its MoE plan: each expert's hidden dimension split, the router replicated; routes replayed at the
    # router's whole-sequence (replicated) output
    "tp2-moe-replay": dict(moe=True, parallel={"dp_shard": 1, "tp": 2}, router_replay=True),
    # glm5-mini's layout on 4 ranks: FSDP over dp_shard x cp, each pair of CP ranks splitting its rows
    "fsdp2-cp2": dict(moe=False, parallel={"dp_shard": 2, "cp": 2}),
    "cp2-ep2-ac": dict(moe=True, parallel={"dp_shard": 1, "cp": 2, "ep": 2}, activation_checkpointing=True),
    # glm5-mini's MoE variant (docs/clusters.md) and glm5's shape: FSDP x CP x EP, routes replayed at each
    # CP rank's positions
    "fsdp2-cp2-ep2-replay": dict(moe=True, parallel={"dp_shard": 2, "cp": 2, "ep": 2}, router_replay=True),
    # EP beside TP on 4 ranks: torchtitan's experts whole on their EP ranks, which it carves from
    # dp_shard x tp, tokens split along the sequence over TP; routes replayed at each rank's slice
    "fsdp2-tp2-ep2-replay": dict(moe=True, parallel={"dp_shard": 2, "tp": 2, "ep": 2}, router_replay=True),
    # EP on the TP ranks alone (no FSDP rank: dp_shard*cp = 1): the EP group is the TP group, each rank
    # owning half the experts whole and dispatching its half of the sequence to them
    "tp2-ep2-replay": dict(moe=True, parallel={"dp_shard": 1, "tp": 2, "ep": 2}, router_replay=True),
    # EP over FSDP and TP ranks together (ep 4 = dp_shard 2 x tp 2: one expert a rank), refused before ep could
    # borrow TP ranks
    "fsdp2-tp2-ep4-replay": dict(moe=True, parallel={"dp_shard": 2, "tp": 2, "ep": 4}, router_replay=True),
}


# eps 1e-4: AdamW's first steps move every weight by ~lr * sign(g); where g is a rounding error (an expert few
# tokens reached) summing over 2 ranks instead of 1 flips that sign, and the weights compare nothing but
# rounding. With eps above those gradients they move by ~lr * g / eps: the comparison holds.
COMMON = dict(max_steps=3, lr=1e-3, eps=1e-4, micro_batch_tokens=48, loss="dppo-kl")


def layout_rollouts(run, model, spec: dict) -> None:
    """The same three steps of rollouts in every run of a layout (routes attached where it replays)."""
    write_rollouts(run, model, range(1, 4), num_prompts=5, group_size=3)
    for step in range(1, 4) if spec.get("router_replay") else ():
        attach_routes(run / "rollouts" / f"step_{step:06d}.safetensors", model, seed=step)


def reference_key(spec: dict) -> tuple[bool, bool]:
    """What a layout's one-rank references depend on: the model (dense or MoE) and replayed routes."""
    return spec["moe"], spec.get("router_replay", False)


@pytest.fixture(scope="module")
def multi_rank_runs(request, tmp_path_factory) -> dict:
    """Every selected layout's torchtitan run on its ranks, those of one world size in one torchrun launch
    (trainer_fixtures.run_trainers_in_one_launch: the imports of a launch cost more than 3 steps):
    layout -> (its folder, with titan2/, its reference folder, and "ok" or why its run failed). Layouts of one
    reference key share one model, one set of rollouts and one pair of one-rank references (`references`)."""
    wanted = [item.callspec.params["layout"] for item in request.session.items
              if item.module is request.module and item.originalname == "test_two_ranks_train_as_one_and_as_transformers"]
    by_world, folders, shared = {}, {}, {}
    for layout in wanted:
        spec = LAYOUTS[layout]
        key = reference_key(spec)
        if key not in shared:
            shared[key] = tmp_path_factory.mktemp("moe-replay" if key[1] else "moe" if key[0] else "dense")
            model = make_tiny_model(shared[key] / "model", moe=spec["moe"])
            layout_rollouts(shared[key] / "rollouts-of", model, spec)
        folder = folders[layout] = tmp_path_factory.mktemp(layout)
        shutil.copytree(shared[key] / "rollouts-of" / "rollouts", folder / "titan2" / "rollouts")
        config = trainer_config(run_dir=str(folder / "titan2"), model_path=str(shared[key] / "model"),
                                engine="torchtitan", parallel=spec["parallel"], router_replay=key[1],
                                activation_checkpointing=spec.get("activation_checkpointing", False), **COMMON)
        by_world.setdefault(config.parallel.world_size, {})[folder / "titan2.json"] = config
    verdicts = {}
    for configs in by_world.values():
        verdicts.update(run_trainers_in_one_launch(configs, timeout=900))
    return {layout: (folder, shared[reference_key(LAYOUTS[layout])], verdicts[folder / "titan2.json"])
            for layout, folder in folders.items()}


@pytest.fixture(scope="module")
def references():
    """The one-rank hf and torchtitan runs of a reference folder (its model and rollouts), each made once."""
    made: dict[Path, dict[str, Path]] = {}

    def of(shared: Path, router_replay: bool) -> dict[str, Path]:
        if shared not in made:
            runs = {name: shared / name for name in ("hf", "titan")}
            common = dict(model_path=str(shared / "model"), router_replay=router_replay, **COMMON)
            for engine, run in (("hf", runs["hf"]), ("torchtitan", runs["titan"])):
                shutil.copytree(shared / "rollouts-of" / "rollouts", run / "rollouts")
                run_trainer(trainer_config(run_dir=str(run), engine=engine, **common))
            made[shared] = runs
        return made[shared]

    return of


@pytest.mark.slow
@pytest.mark.timeout(900)  # the module's multi-rank runs, one launch per world size, start with the first
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_train_as_one_and_as_transformers(multi_rank_runs, references, layout):
    """Three steps on the same rollouts: 2 ranks in each layout follow 1 rank of the torchtitan engine,
    which follows the hf engine's trajectory (fp32; MoE within the grouped experts' tolerance); the
    published weights agree."""
    spec = LAYOUTS[layout]
    folder, shared, verdict = multi_rank_runs[layout]
    assert verdict == "ok", verdict
    replay = spec.get("router_replay", False)
    runs = {**references(shared, replay), "titan2": folder / "titan2"}
    metrics = {name: read_metrics(run / "metrics.jsonl") for name, run in runs.items()}
    engines = 10 * MOE_FP32_TOLERANCE if spec["moe"] else 1e-4  # hf vs torchtitan
    for step in (1, 2, 3):
        names = ["loss", "grad_norm", "behaviour_kl", "entropy", "tokens"]
        if replay:  # replay changed the function; the trainer's own routes agree elsewhere
            names += ["behaviour_kl_no_replay", "routing_agreement"]
            assert metrics["titan"][step]["routing_agreement"] < 0.95
            assert metrics["titan"][step]["behaviour_kl_no_replay"] != metrics["titan"][step]["behaviour_kl"]
        for name in names:
            one = metrics["titan"][step][name]
            assert metrics["titan2"][step][name] == pytest.approx(one, rel=1e-4, abs=1e-6), (step, name)
            assert metrics["hf"][step][name] == pytest.approx(one, rel=engines, abs=1e-6), (step, name)
        # packed documents; CP pads a row's tail to a multiple of 2 x cp columns (context_parallel.py), EP
        # beside TP to a multiple of tp (main.place)
        padding = metrics["titan2"][step]["padding_fraction"]
        if spec["parallel"].get("cp", 1) > 1:
            assert 0.0 < padding < 0.05
        else:
            assert padding < 0.05 if spec["parallel"].get("tp", 1) * spec["parallel"].get("ep", 1) > 2 else padding == 0.0
    assert metrics["titan"][3]["loss"] != metrics["titan"][1]["loss"]  # the trajectory moved
    weights = {name: load_file(step_folder(run / "weights", 3) / "model.safetensors") for name, run in runs.items()}
    assert weights["titan2"].keys() == weights["titan"].keys() == weights["hf"].keys()
    # a random MoE has near-tied routers: a rounding difference can send a token to another expert
    ranks = 2e-5 if spec["moe"] else 2e-6
    for key, tensor in weights["titan"].items():
        torch.testing.assert_close(weights["titan2"][key], tensor, rtol=1e-4, atol=ranks)
        if not spec["moe"]:  # other kernels, other summation orders (the tied embedding's most of all)
            torch.testing.assert_close(weights["hf"][key], tensor, rtol=1e-4, atol=2e-5)


_CONFIGURE_BOTH_WAYS = """
import re, sys
from pathlib import Path
from transformers import AutoConfig
from primebuild.contracts.trainer import ParallelDims
from primebuild.runtime.trainer.titan_parallelize import configure
from primebuild.runtime.trainer.titan_policy import titan_config

def configured(path, dims):
    config = titan_config(AutoConfig.from_pretrained(path), False, exact_experts=True)
    configure(config, ParallelDims(**dims))
    return re.sub(r"0x[0-9a-f]+", "", repr(config))  # functions' addresses differ between builds

cases = [(path, dims) for path in sys.argv[1:] for dims in
         (dict(dp_shard=2, ep=2), dict(dp_shard=2, tp=2, ep=4), dict(dp_replicate=2, dp_shard=1, cp=2))]
placeholder = [configured(*case) for case in cases]
unimported = "torchtitan.trainer" not in sys.modules and "datasets" not in sys.modules
import torchtitan.trainer  # noqa: E402, F401
print(unimported, placeholder == [configured(*case) for case in cases])
"""


def test_configuring_a_layout_leaves_torchtitans_trainer_unimported_and_the_config_as_it_would_make_it(tmp_path):
    """titan_parallelize.configure gives torchtitan's `update_from_config` a placeholder for the one module
    it imports for an isinstance check (torchtitan.trainer, with HF datasets: +111 MiB and ~0.7 s of CPU a
    trainer rank): the configs it makes equal those made with the real module, dense and MoE, EP, TP, CP."""
    paths = [make_tiny_model(tmp_path / name, moe=moe, seed=5) for name, moe in (("dense", False), ("moe", True))]
    done = subprocess.run([sys.executable, "-c", _CONFIGURE_BOTH_WAYS, *map(str, paths)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "True"], done.stdout

def test_the_trainer_checks_again_that_ep_borrows_ranks_it_can():
    """A hand-written config meets the plan's rules at launch (main.check_launch -> check_dims)."""
    from primebuild.contracts.trainer import ParallelDims
    from primebuild.runtime.trainer.parallel_dims import check_dims

    check_dims(ParallelDims(dp_shard=1, tp=2, ep=2), 2)  # the EP group is the TP group
    check_dims(ParallelDims(dp_shard=2, tp=2, ep=4), 4)  # EP over every rank
    with pytest.raises(UserError, match="must divide dp_shard\\*cp\\*tp=2"):
        check_dims(ParallelDims(dp_shard=1, tp=2, ep=4), 2)
    with pytest.raises(UserError, match="no FSDP rank"):
        check_dims(ParallelDims(dp_shard=1, tp=4, ep=2), 4)


def test_the_plan_chooses_torchtitan_where_it_is_built_and_says_why_not_elsewhere(tmp_path):
    def engine(plan):
        return next(p for p in plan["processes"] if p["name"] == "trainer")["config"]["engine"]

    dense = plan_json("manifests/reverse-text.yaml", design=False)
    assert engine(dense) == "torchtitan" and not any("torchtitan" in w for w in dense["warnings"])
    assert engine(plan_json("manifests/reverse-text-moe.yaml", design=False)) == "torchtitan"  # router replay too
    fp8 = plan_json("manifests/reverse-text-moe.yaml", ["trainer.precision=fp8"], design=False)
    assert engine(fp8) == "torchtitan"  # FP8 on torchtitan's linears and experts (titan_fp8.py)
    lora = plan_json("manifests/reverse-text-lora.yaml", design=False)  # LoRA on torchtitan's linears (titan_lora.py)
    assert engine(lora) == "torchtitan" and not any("torchtitan" in w for w in lora["warnings"])
    assert engine(plan_json("manifests/reverse-text.yaml", ["trainer.engine=hf"], design=False)) == "hf"
    refused = run_cli("plan", "manifests/glm5.yaml", "--set", "trainer.engine=torchtitan")
    assert refused.code == 2
    assert "trainer.engine" in refused.err and "no GLM model" in refused.err and "Traceback" not in refused.err


def test_context_and_tensor_parallel_plans_train_on_torchtitan_and_glm5_says_why_not():
    def trainer(plan):  # a multi-node trainer's processes are trainer-n0, trainer-n1, ...
        return next(p for p in plan["processes"] if p["name"].split("-")[0] == "trainer")["config"]

    mini = plan_json("manifests/glm5-mini.yaml", design=False)  # FSDP x CP (dp_shard 2 x cp 2)
    assert trainer(mini)["engine"] == "torchtitan" and trainer(mini)["parallel"]["cp"] == 2
    assert not any("torchtitan" in w for w in mini["warnings"])
    tp = plan_json("manifests/reverse-text.yaml", ["trainer.dp_shard=1", "trainer.tp=2", "trainer.ranks=2"],
                   design=False)
    assert trainer(tp)["engine"] == "torchtitan" and trainer(tp)["parallel"]["tp"] == 2
    # TP is torchtitan's plan: where the trainer runs on transformers' layers it is refused, located
    refused = run_cli("plan", "manifests/reverse-text.yaml", "--set", "trainer.dp_shard=1", "--set", "trainer.tp=2",
                      "--set", "trainer.ranks=2", "--set", "trainer.engine=hf")
    assert refused.code == 2 and "trainer.tp" in refused.err and "Traceback" not in refused.err
    # TP of a MoE, router replay on (test_tensor_parallel_moe_gradients_equal_one_rank, the tp2 layouts)
    moe = plan_json("manifests/reverse-text-moe.yaml", ["trainer.dp_shard=1", "trainer.tp=2", "trainer.ranks=2"],
                    design=False)
    assert trainer(moe)["engine"] == "torchtitan" and trainer(moe)["parallel"]["tp"] == 2 and trainer(moe)["router_replay"]
    beside = plan_json("manifests/reverse-text-moe.yaml", ["trainer.dp_shard=2", "trainer.tp=2", "trainer.ep=2",
                                                           "trainer.ranks=4", "hardware.cpus_per_node=4"], design=False)
    assert trainer(beside)["engine"] == "torchtitan" and trainer(beside)["parallel"]["ep"] == 2
    # EP on the TP ranks alone (the tp2-ep2-replay layout): each of the 2 ranks holds half the model, the
    # experts whole, and gathers nothing (no FSDP rank)
    two = ["trainer.dp_shard=1", "trainer.tp=2", "trainer.ranks=2"]
    borrowed = plan_json("manifests/reverse-text-moe.yaml", [*two, "trainer.ep=2"], design=False)
    assert trainer(borrowed)["engine"] == "torchtitan" and trainer(borrowed)["parallel"]["ep"] == 2
    memory = borrowed["memory"]["trainer"]["breakdown"]
    assert memory["fsdp_buffers"] == 0 and memory["params"] == moe["memory"]["trainer"]["breakdown"]["params"]
    for sets, message in ((["trainer.ep=4"], "ep=4 must divide dp_shard*cp*tp=2"),
                          (["trainer.tp=4", "trainer.ranks=4", "hardware.cpus_per_node=4", "trainer.ep=2"],
                           "ep=2 < tp=4 with no FSDP rank")):
        with pytest.raises(UserError) as err:
            plan_json("manifests/reverse-text-moe.yaml", [*two, *sets], design=False)
        assert [(p.field, message in p.message) for p in err.value.problems] == [("trainer.ep", True)]
    glm5 = plan_json("manifests/glm5.yaml")
    (why,) = [w for w in glm5["warnings"] if w.startswith("trainer: transformers' eager layers")]
    assert "no GLM model" in why and "spmd_types" in why and "torch 2.13" in why
    assert trainer(glm5)["engine"] == "hf"
