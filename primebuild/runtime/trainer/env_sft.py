"""SFT of an environment's demonstrations on the RL trainer, with the early stop on a greedy reward.

The data source of the trainer's SFT (sft.py) for an environment instead of a chat dataset: each step
every rank draws the same `batch_size` tasks and demonstrations from the same seeded RNG (as the old
retired one-process loop drew them), frames them exactly as the orchestrator does (envs/framing.py)
with that loop's loss mask (`episode_ids`: model turns and their `<eos>` are targets; prompts and
environment replies are given), and trains on its share of the packed rows. The loss is sft.py's:
summed NLL of target tokens over the step's target-token count, which is the old loop's mean
cross-entropy over completion tokens.

Early stop: every `check_every` steps from `min_steps` on, the ranks gather the full weights, rank 0
loads them into a transformers model it keeps (one extra fp32 copy of the weights, which the plan
counts) and greedy-decodes the fixed training-side validation tasks; the reward travels to every rank,
so all stop at the same step. Validation tasks come from their own RNG, so they never move the
training data, and greedy decoding draws no random numbers.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path

import torch

from primebuild.contracts.rollout import Sample
from primebuild.contracts.sft import EnvSFTConfig
from primebuild.contracts.trainer import ParallelDims

from .compile_off import off_unless_cuda
from .main import _optimizer_step
from .model import DistEnv
from .parallel_dims import build_meshes
from .sft import _sum_over_ranks, nll_sums
from .teardown import ProcessGroups

log = logging.getLogger("primebuild.sft")

VALIDATION_SEED = 1_000_003  # validation tasks come from their own RNG: training data stay the same


def episode_ids(tokenizer, prompt_ids: list[int], segments, reply_ids) -> tuple[list[int], list[int]]:
    """(ids, mask) of one demonstration (primebuild/runtime/envs/base.py `demonstration`) after its prompt:
    each model turn is encoded and followed by `<eos>` (the engines stop a turn there) and is a target
    (mask 1); each environment segment is `reply_ids(previous model turn's ids, segment)`, as the
    orchestrator frames it (envs/framing.py: plain text, or the chat template's rendering of messages),
    and is not."""
    from primebuild.runtime.envs.transcript import encode_reply

    row, mask, sampled = list(prompt_ids), [0] * len(prompt_ids), []
    for by_model, segment in segments:
        if by_model:
            ids = sampled = encode_reply(tokenizer, segment) + [tokenizer.eos_token_id]
        else:
            ids = reply_ids(sampled, segment)
        row += ids
        mask += [int(by_model)] * len(ids)
    return row, mask


def demonstration_samples(env, framed, tokenizer, tasks, rng: random.Random) -> list[Sample]:
    """The tasks' demonstrations as the trainer's documents: the first token is the prompt (never a
    target), the rest the completion with the old loop's mask."""
    from primebuild.runtime.envs.base import demonstration

    samples = []
    for task in tasks:
        ids, mask = episode_ids(tokenizer, framed.prompt_ids(task), demonstration(env, task, rng),
                                lambda sampled, reply, t=task: framed.reply_ids(t, sampled, reply))
        samples.append(Sample(prompt_ids=ids[:1], completion_ids=ids[1:], inference_logprobs=[0.0] * (len(ids) - 1),
                              advantage=0.0, reward=0.0, policy_version=0, completion_mask=mask[1:]))
    return samples


class GreedyJudge:
    """Rank 0's transformers copy of the trained weights, refreshed from the ranks' shards, and the
    environment's greedy reward of it. Every rank calls `reward` (the gather is collective); every rank
    gets rank 0's number back."""

    def __init__(self, config: EnvSFTConfig, env: DistEnv, environment, tokenizer):
        self.config, self.env, self.environment, self.tokenizer = config, env, environment, tokenizer
        # an environment whose turns are longer than the default (swe-tiny's commands) says how long
        self.max_new_tokens = getattr(environment, "max_tokens_per_turn", config.eval_max_new_tokens)
        self.copy = None
        if env.is_main:
            from transformers import AutoConfig, AutoModelForCausalLM

            self.copy = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config.model_path),
                                                         dtype=torch.float32).eval()

    def reward(self, model, tasks) -> float:
        weights = model.published_weights(torch.float32)
        if self.copy is None:
            weights.drain()
            return _sum_over_ranks([0.0], self.env)[0]
        state = {name: tensor for group in weights.groups() for name, tensor in group}
        missing, unexpected = self.copy.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if self.copy.config.tie_word_embeddings else set()
        if unexpected or set(missing) - tied:
            # checkpoint names that transformers fuses on load (Qwen3-MoE's per-expert projections):
            # go through a folder, so its own loader converts them
            self.copy = self._through_folder(state)
        elif tied:
            self.copy.tie_weights()
        from primebuild.runtime.evaluate import evaluate_tasks

        value = evaluate_tasks(self.copy, self.tokenizer, self.environment, tasks, max_new_tokens=self.max_new_tokens)
        return _sum_over_ranks([value], self.env)[0]


    def _through_folder(self, state: dict):
        import tempfile

        from transformers import AutoConfig

        from primebuild.runtime.evaluate import load_hf_folder
        from primebuild.runtime.weight_sync import filesystem as fs

        with tempfile.TemporaryDirectory(prefix="primebuild-sft-judge-") as tmp:
            fs.write_hf_folder(Path(tmp) / "model", state, AutoConfig.from_pretrained(self.config.model_path),
                               self.config.model_path)
            model, _ = load_hf_folder(Path(tmp) / "model")
        return model


def train_env_sft(config: EnvSFTConfig, out: Path, env: DistEnv, groups: ProcessGroups | None = None) -> dict:
    """Train until the validation reward reaches `stop_at_reward` (or `steps`), write the HF folder `out`
    (rank 0) and return the metrics (the same on every rank)."""
    from transformers import AutoTokenizer

    from primebuild.runtime.envs.framing import framing
    from primebuild.runtime.envs.registry import load_environment
    from primebuild.runtime.weight_sync import filesystem as fs

    off_unless_cuda(env.device)
    from .titan_policy import load_titan_model

    started = time.perf_counter()
    torch.manual_seed(config.seed)
    tokenizer = AutoTokenizer.from_pretrained(config.model_path)
    environment = load_environment(config.env_id, config.env_version, config.env_args)
    framed = framing(environment, tokenizer)  # plain text, or the model's chat template, as the orchestrator frames
    rng = random.Random(config.seed)
    validation = (environment.sample_tasks(random.Random(VALIDATION_SEED), config.validation_n)
                  if config.stop_at_reward is not None else [])
    dims = ParallelDims(dp_shard=env.world_size)
    model = load_titan_model(config.model_path, env, "float32", False, config.logprob_chunk_tokens, dims,
                             seed=config.seed)
    meshes = build_meshes(dims, env.world_size, env.rank, env.device.type)
    if groups is not None:  # the meshes' groups end in teardown.py's order, as the RL trainer's do
        groups.track(meshes.world)
        groups.track(model.world_mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    judge = GreedyJudge(config, env, environment, tokenizer)
    held_out = environment.eval_tasks()[: config.eval_n]
    curve, eval_curve, validation_curve, validation_reward, packed_total = [], [], [], None, 0.0
    step = 0
    for step in range(1, config.steps + 1):
        samples = demonstration_samples(environment, framed, tokenizer, environment.sample_tasks(rng, config.batch_size), rng)
        normalizer = float(max(1, sum(s.num_loss_tokens for s in samples)))
        nll, _, packed = nll_sums(model, samples, config, env, normalizer)
        bad = None if torch.isfinite(nll).item() else "of this step"
        grad_norm, lr = _optimizer_step(model, optimizer, config, env, meshes, step, bad)
        total_nll, total_packed = _sum_over_ranks([float(nll), packed], env)
        curve.append(total_nll / normalizer)
        packed_total += total_packed
        if env.is_main:
            log.info("step %d loss %.5f grad_norm %.3g lr %.3g", step, curve[-1], grad_norm.item(), lr)
        if held_out and config.eval_every and step % config.eval_every == 0 and step < config.steps:
            eval_curve.append((step, judge.reward(model, held_out)))
            if env.is_main:
                log.info("step %d held-out reward %.4f", step, eval_curve[-1][1])
        if validation and step >= config.min_steps and step % config.check_every == 0:
            validation_reward = judge.reward(model, validation)
            validation_curve.append((step, validation_reward))
            if env.is_main:
                log.info("step %d validation reward %.4f", step, validation_reward)
            if validation_reward >= config.stop_at_reward:
                break
    train_seconds = time.perf_counter() - started
    eval_reward = judge.reward(model, held_out) if held_out else None
    weights = model.published_weights(torch.float32)
    if env.is_main:
        fs.write_hf_folder(out, weights, model.config, config.model_path)
    else:
        weights.drain()
    metrics = {
        "trainer": "torchtitan", "ranks": env.world_size, "steps": step, "validation_reward": validation_reward,
        "loss_curve": curve, "final_loss": curve[-1], "mean_loss_last_10": sum(curve[-10:]) / len(curve[-10:]),
        "eval_reward": eval_reward, "train_seconds": train_seconds, "packed_tokens_per_s": packed_total / train_seconds,
        "validation_curve": validation_curve, "seconds": time.perf_counter() - started,
    }
    if eval_curve:
        metrics["eval_curve"] = eval_curve
    return metrics
