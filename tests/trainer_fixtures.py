"""A tiny random model, synthetic rollout batches and trainer configs: the trainer tests' fixtures.

Inference log-probs are computed the way an inference server would: one unpadded HF forward per sample
under the base weights, so at step 1 (fp32 on both sides) the trainer's mismatch KL must be ~0.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from primebuild.contracts.rollout import RolloutBatch, Sample
from primebuild.contracts.trainer import TrainerConfig
from primebuild.runtime.orchestrator.advantages import group_relative_advantages
from primebuild.runtime.rollout_file import load_batch, save_batch

# What the plan compiler always sets and tests rarely care about.
CONFIG_DEFAULTS = {"max_completion_tokens": 16, "temperature": 1.0, "lr": 1e-3, "max_steps": 3,
                   "micro_batch_tokens": 64, "logprob_chunk_tokens": 16}  # several chunks per micro-batch


def trainer_config(**fields) -> TrainerConfig:
    """A TrainerConfig with the defaults above; `loss="cispo"` is short for `loss={"name": "cispo"}`."""
    if isinstance(fields.get("loss"), str):
        fields["loss"] = {"name": fields["loss"]}
    return TrainerConfig.model_validate({**CONFIG_DEFAULTS, **fields})


def make_tiny_model(path: str | Path, moe: bool = False, seed: int = 0, vocab_size: int = 96) -> Path:
    """Save a random Qwen3 (or Qwen3-MoE) with hidden 64 and 2 layers under ``path``."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    if moe:
        config = Qwen3MoeConfig(
            intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, **common
        )
    else:
        config = Qwen3Config(intermediate_size=128, **common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    path = Path(path)
    model.save_pretrained(path)
    return path


@torch.no_grad()
def hf_completion_logprobs(model, prompt_ids: list[int], completion_ids: list[int], temperature: float = 1.0):
    ids = torch.tensor([prompt_ids + completion_ids])
    logits = model(input_ids=ids).logits[0].float() / temperature
    p = len(prompt_ids)
    lp = torch.log_softmax(logits[p - 1 : -1], dim=-1)
    return lp.gather(-1, torch.tensor(completion_ids).unsqueeze(-1)).squeeze(-1).tolist()


def make_batch(
    model, step: int, num_prompts: int = 4, group_size: int = 4, seed: int = 0, policy_version: int = 0
) -> RolloutBatch:
    """Random prompts and completions of varied length, rewards in {0, 1}, group-relative advantages."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    vocab = model.config.vocab_size
    samples = []
    for _ in range(num_prompts):
        prompt = torch.randint(1, vocab, (int(torch.randint(2, 8, (1,), generator=g)),), generator=g).tolist()
        rewards = torch.randint(0, 2, (group_size,), generator=g).float()
        adv = group_relative_advantages(rewards.unsqueeze(0).numpy())[0].tolist()
        for j in range(group_size):
            n = int(torch.randint(1, 12, (1,), generator=g))
            completion = torch.randint(1, vocab, (n,), generator=g).tolist()
            samples.append(
                Sample(
                    prompt_ids=prompt,
                    completion_ids=completion,
                    inference_logprobs=hf_completion_logprobs(model, prompt, completion),
                    advantage=adv[j],
                    reward=float(rewards[j]),
                    policy_version=policy_version,
                    env_id="synthetic",
                )
            )
    return RolloutBatch(step=step, samples=samples, temperature=1.0)


def write_rollouts(run_dir: str | Path, model_path: str | Path, steps: range, **kwargs) -> None:
    """Write ``rollouts/step_k.safetensors`` for every k in ``steps``, all sampled from the base model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    for k in steps:
        save_batch(Path(run_dir) / "rollouts" / f"step_{k:06d}.safetensors", make_batch(model, k, **kwargs))


def attach_routes(batch_path, model_path, seed: int) -> None:
    """Attach routes to every sample: the HF router's own choice, with every 4th position's experts
    replaced (so replay changes the function), as uint8 [fed positions, moe_layers, top_k]."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    batch = load_batch(batch_path)
    g = torch.Generator().manual_seed(seed)
    k, experts = hf.config.num_experts_per_tok, hf.config.num_experts
    for s in batch.samples:
        ids = torch.tensor([s.prompt_ids + s.completion_ids[:-1]])
        with torch.no_grad():
            logits = hf(ids, output_router_logits=True).router_logits
        routes = torch.stack([r.topk(k, -1).indices for r in logits], dim=1)  # [fed, layers, k]
        other = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(routes.shape[0] * routes.shape[1])])
        other = other.view_as(routes)
        routes[::4] = other[::4]
        s.routed_experts = routes.to(torch.uint8)
    save_batch(batch_path, batch)


def run_trainer_ranks(config: TrainerConfig, config_path: Path, timeout: float = 250) -> subprocess.CompletedProcess:
    """The trainer under torchrun, one gloo rank per `config.parallel.world_size` (one OMP thread each),
    reading `config` from `config_path`; fails with the tail of its output, else returns the finished process."""
    from conftest import free_port

    config_path.write_text(config.model_dump_json())
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={config.parallel.world_size}",
                           f"--master_port={free_port()}", "-m", "primebuild.runtime.trainer.main",
                           "--config", str(config_path)],
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


ENDS_WORKER = Path(__file__).with_name("trainer_ends_worker.py")


def run_trainers_in_one_launch(configs: dict[Path, TrainerConfig], timeout: float = 600,
                               output: list[str] | None = None) -> dict[Path, str]:
    """Several trainer runs of one world size, one after the other in the same torchrun ranks
    (tests/trainer_ends_worker.py): a launch pays torch's, transformers' and torchtitan's imports (most of
    a short run's time on 2 cores) once for all of them. Each config is written to its path. Returns, per
    path, "ok" or why that run failed (its exit code, gloo threads left, or never reached: a rank died);
    a caller asserts on its own runs only. Not every pair of layouts may follow each other in one process
    (bench/RESULTS.md "Test suite time": HSDP then HSDP x CP x EP failed); a new sequence is checked once
    (group names are counters: one that passes passes every time). `output`, if given, gets the launch's
    stdout and stderr."""
    from conftest import free_port

    (world,) = {c.parallel.world_size for c in configs.values()}
    for path, config in configs.items():
        path.write_text(config.model_dump_json())
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
                           f"--master_port={free_port()}", str(ENDS_WORKER), *map(str, configs)],
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=timeout)
    tail = proc.stdout[-3000:] + proc.stderr[-3000:]
    if output is not None:
        output += [proc.stdout, proc.stderr]
    ends: dict[str, list[tuple[str, str]]] = {}
    for path, code, left in re.findall(r"end \d+ (\S+) exit (-?\d+) gloo_threads (\d+)", proc.stdout):
        ends.setdefault(path, []).append((code, left))
    verdicts = {}
    for path in configs:
        got = ends.get(str(path), [])
        if len(got) == world and all(e == ("0", "0") for e in got):
            verdicts[path] = "ok"
        else:
            verdicts[path] = f"{path.name}: (exit, gloo threads) per rank {got}, launch exit {proc.returncode}\n{tail}"
    return verdicts
