"""SFT on the RL trainer: a chat dataset, torchtitan's model, FSDP2, packed documents, assistant-only NLL.

    torchrun --nproc-per-node N -m primebuild.runtime.trainer.sft --config ChatSFTConfig.json --out DIR --metrics M.json

An EnvSFTConfig (kind env-sft) trains on an environment's demonstrations instead (env_sft.py).

The pieces are the RL step's (main.py): load_titan_model (meta init, FSDP2 over the ranks, each rank its
shards of the HF checkpoint), batch.pack (chats as documents in rows of `micro_batch_tokens`, document
mask, balanced over ranks, every rank the same number of rows), main._optimizer_step (finite checks,
global-norm clip, AdamW at the warm-up lr) and the HF writer of weight publishing. Only the loss differs:
the summed NLL of assistant tokens over the step's assistant-token count, a constant of the whole step, so
1 rank and N ranks compute the same gradient (torchtitan's FSDP sums gradients over ranks).

A chat is rendered by the model's chat template; the tokens of assistant turn i are those the template adds
to messages[:i] rendered with the generation prompt, up to and including its end-of-turn token (what
the engines stop on). Everything else (system, user, tool turns, the template's framing) is given.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from primebuild.contracts.base import load_contract
from primebuild.contracts.rollout import Sample
from primebuild.contracts.sft import ChatSFTConfig, EnvSFTConfig
from primebuild.contracts.trainer import ParallelDims
from primebuild.errors import UserError

from .batch import pack
from .compile_off import off_unless_cuda
from .main import _optimizer_step
from .model import DistEnv, init_distributed
from .parallel_dims import build_meshes
from .teardown import ProcessGroups

log = logging.getLogger("primebuild.sft")


def _template_ids(tokenizer, messages: list[dict], generation_prompt: bool, tools: list[dict] | None) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_chat(tokenizer, messages: list[dict], where: str = "", tools: list[dict] | None = None
                ) -> tuple[list[int], list[int]]:
    """(ids, mask) of one chat: mask[t] = 1 where token t is an assistant token the loss trains on."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"{where}the model's tokenizer has no chat template",
                        hint="start from a model whose tokenizer_config.json has one (tokenizer: chat for init)")
    ids = _template_ids(tokenizer, messages, False, tools)
    mask = [0] * len(ids)
    eos = tokenizer.eos_token_id
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _template_ids(tokenizer, messages[:i], True, tools) if i else []
        through = _template_ids(tokenizer, messages[: i + 1], False, tools)
        if through[: len(before)] != before or ids[: len(through)] != through:
            raise UserError(f"{where}the chat template does not render messages[{i}] as an extension of the "
                            "turns before it: the assistant tokens cannot be told apart",
                            hint="use a model whose chat template renders each turn after the previous ones")
        turn = through[len(before):]
        end = len(turn) if eos not in turn else turn.index(eos) + 1  # the template's newline after it is given
        mask[len(before): len(before) + end] = [1] * end
    return ids, mask


def chat_samples(tokenizer, chats: list[dict], source: str) -> list[Sample]:
    """Chats as the trainer's documents: the first token is the prompt (never a target), the rest the
    completion with the assistant mask; no log-probs, advantages or rewards are read by the SFT loss."""
    samples = []
    for row, chat in enumerate(chats, start=1):
        ids, mask = encode_chat(tokenizer, chat["messages"], f"{source}: row {row}: ", chat["tools"])
        if sum(mask[1:]) == 0:
            raise UserError(f"{source}: row {row}: no assistant token after the template's first token")
        n = len(ids) - 1
        samples.append(Sample(prompt_ids=ids[:1], completion_ids=ids[1:], inference_logprobs=[0.0] * n,
                              advantage=0.0, reward=0.0, policy_version=0, completion_mask=mask[1:]))
    return samples


def batches(train: list[Sample], batch_size: int, seed: int):
    """Endless steps of `batch_size` samples: each epoch a fresh permutation (seeded, so every rank
    draws the same steps)."""
    epoch, queue = 0, []
    while True:
        while len(queue) < batch_size:
            order = list(range(len(train)))
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
            queue += order
            epoch += 1
        step, queue = queue[:batch_size], queue[batch_size:]
        yield [train[i] for i in step]


def nll_sums(model, samples: list[Sample], config: ChatSFTConfig, env: DistEnv, normalizer: float | None):
    """This rank's (NLL sum, assistant tokens, packed tokens) over its share of `samples`; with a
    `normalizer` each micro-batch's NLL / normalizer is also back-propagated."""
    rows = pack(samples, config.micro_batch_tokens, env.world_size)[env.rank]
    nll = torch.zeros((), dtype=torch.float64)
    tokens = packed = 0
    for mb in rows:
        lp, _ = model(mb.input_ids.to(env.device), mb.position_ids.to(env.device), 1.0)
        mask = mb.loss_mask.to(env.device)
        loss_sum = -torch.where(mask, lp, 0.0).sum()
        if normalizer is not None:
            (loss_sum / normalizer).backward()
        nll += loss_sum.detach().double().cpu()
        tokens += int(mask.sum())
        packed += 0 if mb.is_empty else mb.num_tokens
    return nll, tokens, packed


def _sum_over_ranks(values: list[float], env: DistEnv) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if env.distributed:
        t = t.to(env.device)
        dist.all_reduce(t)
    return t.cpu().tolist()


@torch.no_grad()
def held_out_loss(model, samples: list[Sample], config: ChatSFTConfig, env: DistEnv) -> float:
    nll, tokens, _ = nll_sums(model, samples, config, env, None)
    total_nll, total_tokens = _sum_over_ranks([float(nll), tokens], env)
    return total_nll / max(total_tokens, 1.0)


def train_sft(config: ChatSFTConfig, out: Path, env: DistEnv, groups: ProcessGroups | None = None) -> dict:
    """Train, write the HF folder `out` (rank 0) and return the metrics (the same on every rank)."""
    from transformers import AutoTokenizer

    from primebuild.builders.chat_dataset import read_chats
    from primebuild.runtime.weight_sync import filesystem as fs

    off_unless_cuda(env.device)
    from .titan_policy import load_titan_model

    torch.manual_seed(config.seed)
    tokenizer = AutoTokenizer.from_pretrained(config.model_path)
    chats = read_chats(config.dataset_path)
    samples = chat_samples(tokenizer, chats, config.dataset_path)
    train, held_out = samples[: len(samples) - config.eval_rows], samples[len(samples) - config.eval_rows:]
    if not train:
        raise UserError(f"{config.dataset_path}: eval_rows={config.eval_rows} holds out every row",
                        hint="lower sft.dataset.eval_rows")
    model = load_titan_model(config.model_path, env, "float32", False, config.logprob_chunk_tokens,
                             ParallelDims(dp_shard=env.world_size), seed=config.seed)
    meshes = build_meshes(ParallelDims(dp_shard=env.world_size), env.world_size, env.rank, env.device.type)
    if groups is not None:  # the meshes' groups end in teardown.py's order, as the RL trainer's do
        groups.track(meshes.world)
        groups.track(model.world_mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    curve, eval_curve, tokens_total, packed_total = [], [], 0.0, 0.0
    started = time.perf_counter()
    stream = batches(train, config.batch_size, config.seed)
    for step in range(1, config.steps + 1):
        step_samples = next(stream)
        normalizer = float(max(1, sum(s.num_loss_tokens for s in step_samples)))
        nll, tokens, packed = nll_sums(model, step_samples, config, env, normalizer)
        bad = None if torch.isfinite(nll).item() else "of this step"
        grad_norm, lr = _optimizer_step(model, optimizer, config, env, meshes, step, bad)
        total_nll, total_tokens, total_packed = _sum_over_ranks([float(nll), tokens, packed], env)
        curve.append(total_nll / normalizer)
        tokens_total += total_tokens
        packed_total += total_packed
        if env.is_main:
            log.info("step %d loss %.5f grad_norm %.3g lr %.3g", step, curve[-1], grad_norm.item(), lr)
        if held_out and (step == config.steps or config.eval_every and step % config.eval_every == 0):
            eval_curve.append((step, held_out_loss(model, held_out, config, env)))
            if env.is_main:
                log.info("step %d held-out loss %.5f", step, eval_curve[-1][1])
    seconds = time.perf_counter() - started
    weights = model.published_weights(torch.float32)
    if env.is_main:
        fs.write_hf_folder(out, weights, model.config, config.model_path)
    else:
        weights.drain()
    return {
        "trainer": "torchtitan", "ranks": env.world_size, "steps": config.steps, "loss_curve": curve,
        "final_loss": curve[-1], "mean_loss_last_10": sum(curve[-10:]) / len(curve[-10:]),
        "eval_loss_curve": eval_curve, "eval_loss": eval_curve[-1][1] if eval_curve else None,
        "train_rows": len(train), "eval_rows": len(held_out), "train_seconds": seconds,
        "steps_per_s": config.steps / seconds, "packed_tokens_per_s": packed_total / seconds,
        "assistant_tokens_per_s": tokens_total / seconds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m primebuild.runtime.trainer.sft", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="a ChatSFTConfig or EnvSFTConfig as JSON, placeholders resolved")
    parser.add_argument("--out", required=True, help="the HF folder to write (must not exist)")
    parser.add_argument("--metrics", required=True, help="where rank 0 writes the run's metrics as JSON")
    args = parser.parse_args(argv)
    env = init_distributed()
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s [sft rank {env.rank}] %(message)s")
    groups = ProcessGroups()
    finished = False
    try:
        is_env = json.loads(Path(args.config).read_text()).get("kind") == "env-sft"
        config = load_contract(EnvSFTConfig if is_env else ChatSFTConfig, args.config)
        torch.set_num_threads(config.num_threads)
        if Path(args.out).exists():
            raise UserError(f"{args.out}: output folder already exists", hint="choose a new folder")
        if is_env:
            from .env_sft import train_env_sft

            metrics = train_env_sft(config, Path(args.out), env, groups)
        else:
            metrics = train_sft(config, Path(args.out), env, groups)
        if env.is_main:
            Path(args.metrics).write_text(json.dumps(metrics, indent=2))
        finished = True
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        groups.close(finished, default_group=env.distributed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
