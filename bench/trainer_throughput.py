"""Trainer tokens/s on CPU: packed documents vs right-padded rows, torchtitan's modules vs transformers'.

One training step's forward and backward over every micro-batch of a batch (fp32, one process, one
intra-op thread, no optimizer step), timed in process CPU seconds (the contender's own work: it moves far
less with other load on the machine than wall time) as the median of `--repeats` after a warm-up;
tokens/s counts real tokens only.
Contenders, side by side on the same model, samples and token budget:
  padded     transformers' layers, rows right-padded to the longest of their micro-batch (what the trainer
             did before samples were packed: rows x longest row within micro_batch_tokens)
  packed     transformers' layers, samples packed as documents (runtime/trainer/batch.py)
  torchtitan torchtitan's Qwen3 modules, packed (runtime/trainer/titan_policy.py)
Workloads: the main job's (128 samples, prompts of 5-30 tokens, completions of 1-16) and a long-tail
one (32 samples, 32-1024 tokens, log-uniform), which right-padding wastes most on.

    .venv/bin/python bench/trainer_throughput.py [--model tiny|20m] [--repeats 3]
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from primebuild.contracts.rollout import Sample
from primebuild.runtime.trainer.batch import MicroBatch, pack
from primebuild.runtime.trainer.model import DistEnv, load_model
from primebuild.runtime.trainer.titan_policy import load_titan_model

MODELS = {
    "tiny": dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=32),
    "20m": dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4, head_dim=64, vocab_size=4096),
}


def make_model(folder: Path, name: str) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen3Config(max_position_embeddings=2048, tie_word_embeddings=True,
                                                 **MODELS[name])).save_pretrained(folder)
    return folder


def workload(name: str, vocab: int) -> tuple[list[Sample], int]:
    """(samples, micro_batch_tokens)"""
    g = torch.Generator().manual_seed(1)

    def draw(lo: int, hi: int, log: bool = False) -> int:
        u = torch.rand((), generator=g).item()
        return int(math.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))) if log else lo + int(u * (hi - lo + 1))

    if name == "main-job":
        shapes, budget = [(draw(5, 30), draw(1, 16)) for _ in range(128)], 512
    else:
        shapes, budget = [(draw(16, 512, log=True), draw(16, 512, log=True)) for _ in range(32)], 2048
    samples = [Sample(prompt_ids=torch.randint(1, vocab, (p,), generator=g).tolist(),
                      completion_ids=torch.randint(1, vocab, (c,), generator=g).tolist(),
                      inference_logprobs=[-1.0] * c, advantage=1.0, reward=1.0, policy_version=0)
               for p, c in shapes]
    return samples, budget


def padded_micro_batches(samples: list[Sample], budget: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The former trainer's split: longest first, first fit while rows x longest row <= budget, right-padded.
    (input_ids, position_ids, loss_mask) per micro-batch."""
    order = sorted(range(len(samples)), key=lambda i: -samples[i].num_tokens)
    groups: list[list[int]] = []
    for i in order:
        for group in groups:
            if (len(group) + 1) * samples[group[0]].num_tokens <= budget:
                group.append(i)
                break
        else:
            groups.append([i])
    out = []
    for group in groups:
        width = samples[group[0]].num_tokens
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.bool)
        for row, i in enumerate(group):
            s = samples[i]
            ids[row, : s.num_tokens] = torch.tensor(s.prompt_ids + s.completion_ids)
            mask[row, len(s.prompt_ids): s.num_tokens] = True
        out.append((ids, torch.arange(width).expand(len(group), -1), mask))
    return out


def packed_micro_batches(samples: list[Sample], budget: int):
    mbs: list[MicroBatch] = pack(samples, budget, world_size=1)[0]
    return [(mb.input_ids, mb.position_ids, mb.loss_mask) for mb in mbs]


def step_seconds(policy, micro_batches, repeats: int) -> float:
    def once() -> float:
        policy.zero_grad(set_to_none=True)
        start = time.process_time()
        for ids, positions, mask in micro_batches:
            lp, _ = policy(ids, positions, 1.0)
            (lp * mask).sum().backward()
        return time.process_time() - start

    once()  # warm-up
    return statistics.median(once() for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    env = DistEnv(0, 1, torch.device("cpu"))
    with tempfile.TemporaryDirectory() as tmp:
        path = str(make_model(Path(tmp), args.model))
        hf = load_model(path, env, "float32", False, 8192)
        titan = load_titan_model(path, env, "float32", False, 8192)
        print(f"model {args.model}, fp32, {args.threads} thread(s); real tokens per CPU-second of one step's "
              f"forward+backward (median of {args.repeats})")
        print(f"{'workload':<10} {'padding':>8} {'padded':>10} {'packed':>10} {'torchtitan':>11} "
              f"{'packed/padded':>14} {'titan/padded':>13}")
        for name in ("main-job", "long-tail"):
            samples, budget = workload(name, MODELS[args.model]["vocab_size"])
            real = sum(s.num_tokens for s in samples)
            padded = padded_micro_batches(samples, budget)
            packed = packed_micro_batches(samples, budget)
            waste = 1 - real / sum(ids.numel() for ids, _, _ in padded)
            rate = {label: real / step_seconds(policy, mbs, args.repeats)
                    for label, policy, mbs in (("padded", hf, padded), ("packed", hf, packed),
                                               ("torchtitan", titan, packed))}
            print(f"{name:<10} {waste:>8.1%} {rate['padded']:>10,.0f} {rate['packed']:>10,.0f} "
                  f"{rate['torchtitan']:>11,.0f} {rate['packed'] / rate['padded']:>13.2f}x "
                  f"{rate['torchtitan'] / rate['padded']:>12.2f}x")


if __name__ == "__main__":
    main()
