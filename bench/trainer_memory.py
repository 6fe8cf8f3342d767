"""The plan's trainer memory model (primebuild/builders/memory.py) vs what the trainer allocates per rank, on CPU,
for EP and CP layouts of a tiny model (issue P9).

For each layout the trainer's own code (load_model with the run's device mesh, train_step) runs one
optimizer step under torchrun (gloo), and every rank reports what it holds:

- params / grads / optimizer state: bytes of its local shards (FSDP shards, EP-owned experts), summed
  over `model.parameters()`, their `.grad`, and AdamW's exp_avg + exp_avg_sq;
- activations: bytes of the tensors autograd saves for backward during one micro-batch's forward
  (saved_tensors_hooks, each storage counted once; parameters excluded), what the memory model's
  `activations` + `logits` terms estimate.

The model side is `trainer_memory_per_gpu` with the same layout (fp32 everywhere, no checkpointing) and
the activation factor the plan uses on a CPU (CPU_EAGER_ACTIVATION_FACTOR, fitted here on the 1-rank
runs). Printed side by side with ratios; the plan's promise is within 10%.

    .venv/bin/python bench/trainer_memory.py
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

MICRO_BATCH_TOKENS = 256  # one micro-batch: 4 rows of 64 tokens
LAYOUTS = {  # name: (moe, parallel dims, ranks)
    "dense, 1 rank": (False, {"dp_shard": 1}, 1),
    "dense, cp=2": (False, {"dp_shard": 1, "cp": 2}, 2),
    "dense, dp_shard=2": (False, {"dp_shard": 2}, 2),
    "moe, 1 rank": (True, {"dp_shard": 1}, 1),
    "moe, dp_shard=2 ep=2": (True, {"dp_shard": 2, "ep": 2}, 2),
}


def model_config(moe: bool) -> dict:
    common = dict(vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, max_position_embeddings=256, tie_word_embeddings=False)
    if moe:
        return dict(model_type="qwen3_moe", intermediate_size=256, moe_intermediate_size=128, num_experts=8,
                    num_experts_per_tok=2, **common)
    return dict(model_type="qwen3", intermediate_size=512, **common)


def build(folder: Path, moe: bool) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = model_config(moe)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def run_rank(folder: str, parallel: dict, out: str) -> None:
    import torch
    from torch.autograd.graph import saved_tensors_hooks

    from primebuild.contracts.rollout import RolloutBatch, Sample
    from primebuild.contracts.trainer import TrainerConfig
    from primebuild.runtime.trainer import main as trainer
    from primebuild.runtime.trainer.finite import local
    from primebuild.runtime.trainer.losses import resolve_loss
    from primebuild.runtime.trainer.model import init_distributed, load_model
    from primebuild.runtime.trainer.parallel_dims import build_meshes

    torch.set_num_threads(1)
    env = init_distributed()
    config = TrainerConfig(model_path=folder, run_dir=tempfile.mkdtemp(), max_completion_tokens=32, temperature=1.0,
                           lr=1e-3, max_steps=1, micro_batch_tokens=MICRO_BATCH_TOKENS, logprob_chunk_tokens=8192,
                           parallel=parallel)
    meshes = build_meshes(config.parallel, env.world_size, env.rank, env.device.type)
    model = load_model(folder, env, "float32", False, config.logprob_chunk_tokens, meshes=meshes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    dp = parallel.get("dp_shard", 1)
    # every dp rank gets one micro-batch of 4 rows x 64 tokens (32 prompt + 32 completion)
    samples = [Sample(prompt_ids=torch.randint(1, 500, (32,), generator=g).tolist(),
                      completion_ids=torch.randint(1, 500, (32,), generator=g).tolist(),
                      inference_logprobs=[-6.0] * 32, advantage=float(i % 2) - 0.5, reward=0.0, policy_version=0)
               for i in range(4 * dp)]

    saved: dict[int, int] = {}

    def weight_storages() -> set[int]:
        """Storages of the parameters as modules see them now (FSDP swaps in the gathered ones during
        forward; EP's are DTensors whose local part is what the experts multiply with)."""
        out = set()
        for module in model.modules():
            for name, _ in module.named_parameters(recurse=False):
                value = getattr(module, name)
                out.add(local(value).untyped_storage().data_ptr())
        return out

    def pack(t):
        if t.untyped_storage().data_ptr() not in weight_storages():  # weights are not activations
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    loss_fn = resolve_loss("grpo", {})
    with saved_tensors_hooks(pack, lambda t: t):
        trainer.train_step(model, optimizer, RolloutBatch(step=1, samples=samples, temperature=1.0),
                           config, loss_fn, env, 1, meshes)
    # train_step frees the gradients (zero_grad(set_to_none)); FSDP's reduced gradients are shaped like
    # the sharded parameters, so allocate them that way to count them
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    grads = _bytes(local(p.grad) for p in model.parameters())
    state = [v for s in optimizer.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    result = {"params": _bytes(local(p) for p in model.parameters()), "grads": grads,
              "optimizer_state": _bytes(local(t) for t in state), "activations": sum(saved.values())}
    Path(out, f"rank{env.rank}.json").write_text(json.dumps(result))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def modelled(facts, parallel: dict, activation_factor: float | None = None) -> dict:
    from primebuild.builders.memory import CPU_EAGER_ACTIVATION_FACTOR, trainer_memory_per_gpu

    m = trainer_memory_per_gpu(facts, param_dtype="fp32", master_dtype=None, grad_dtype="fp32",
                               dp_shard=parallel.get("dp_shard", 1), cp=parallel.get("cp", 1),
                               ep=parallel.get("ep", 1), activation_checkpointing=False,
                               micro_batch_tokens=MICRO_BATCH_TOKENS, seq_len=64, gpu_memory_bytes=1 << 40,
                               activation_dtype="fp32", logits_chunk_tokens=8192,
                               activation_factor=activation_factor or CPU_EAGER_ACTIVATION_FACTOR)
    return {"params": m.params, "grads": m.grads, "optimizer_state": m.optimizer_state,
            "activations": m.activations + m.logits}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank-of", nargs=3, metavar=("FOLDER", "PARALLEL", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of:
        folder, parallel, out = args.rank_of
        run_rank(folder, json.loads(parallel), out)
        return 0
    from primebuild.builders.model_facts import load_model_facts

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for moe in (False, True):
            build(Path(tmp, f"moe{moe}"), moe)
        for name, (moe, parallel, ranks) in LAYOUTS.items():
            folder, out = Path(tmp, f"moe{moe}"), Path(tmp, name.replace(" ", "_").replace(",", ""))
            out.mkdir()
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
                   f"--master_port={free_port()}", __file__, "--rank-of", str(folder), json.dumps(parallel), str(out)]
            done = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{name}: the trainer failed:\n{done.stderr[-6000:]}")
            measured = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(ranks)]
            facts = load_model_facts(folder / "config.json")
            rows.append((name, facts, parallel, modelled(facts, parallel), measured))
    print(f"{'layout':22} {'what':16} {'model/rank':>12} {'measured (per rank)':>26} {'model/max':>9}")
    for name, _, _, model, measured in rows:
        for key in ("params", "grads", "optimizer_state", "activations"):
            per_rank = [m[key] for m in measured]
            sharded = model[key]
            print(f"{name:22} {key:16} {sharded:12,d} {', '.join(f'{v:,d}' for v in per_rank):>26} "
                  f"{sharded / max(per_rank):9.3f}")
        static = [m["params"] + m["grads"] + m["optimizer_state"] for m in measured]
        total = model["params"] + model["grads"] + model["optimizer_state"]
        print(f"{name:22} {'params+grads+opt':16} {total:12,d} {', '.join(f'{v:,d}' for v in static):>26} "
              f"{total / max(static):9.3f}")
    # How CPU_EAGER_ACTIVATION_FACTOR was found: fitted on each model's own 1-rank run, what is left to
    # compare is the model's CP and EP scaling.
    from primebuild.builders.memory import CPU_EAGER_ACTIVATION_FACTOR as f_cpu

    print("\nactivations with the factor fitted on the model's own 1-rank run:")
    fitted = {}
    for name, folder, _, model, measured in rows:
        if name.endswith("1 rank"):
            fitted[folder.architecture] = f_cpu * measured[0]["activations"] / model["activations"]
    for name, folder, parallel, _, measured in rows:
        model = modelled(folder, parallel, fitted[folder.architecture])["activations"]
        worst = max(m["activations"] for m in measured)
        print(f"{name:22} factor {fitted[folder.architecture]:.3f}  model {model:12,d}  measured {worst:12,d}  model/measured "
              f"{model / worst:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
