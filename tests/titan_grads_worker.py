"""One rank of tests/test_trainer_titan.py's gradient parity: torchtitan's Qwen3 MoE under tensor parallelism
takes one backward on a fixed packed batch; rank 0 saves every parameter's whole gradient and the trainer's
gradient norm (main._grad_norm) for the test to compare with one rank's.

    torchrun --nproc_per_node=2 tests/titan_grads_worker.py MODEL OUT.pt [fp8|lora [EP]]

With `fp8` the blocks compute in FP8 (titan_fp8.py); with `lora` adapters on the attention projections
train (titan_lora.py), drawn at random (`random_adapters`) so that every one has a gradient; EP (default 1)
beside TP.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from primebuild.contracts.trainer import LoraConfig, ParallelDims
from primebuild.runtime.trainer.lora import adapter_tensors
from primebuild.runtime.trainer.main import _grad_norm
from primebuild.runtime.trainer.model import init_distributed
from primebuild.runtime.trainer.parallel_dims import build_meshes
from primebuild.runtime.trainer.sharded_load import _local_block
from primebuild.runtime.trainer.titan_policy import load_titan_model


def fixed_batch(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two packed rows of 48 tokens, documents crossing nothing (positions restart at 0), and fixed
    per-token weights for the loss: (input_ids, position_ids, weights)."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, vocab_size, (2, 48), generator=g)
    positions = torch.stack([torch.cat([torch.arange(20), torch.arange(28)]),
                             torch.cat([torch.arange(7), torch.arange(30), torch.arange(11)])])
    return ids, positions, torch.rand(2, 48, generator=g)


def loss_of(policy, vocab_size: int) -> torch.Tensor:
    """A fixed weighting of the batch's log-probs and entropies (both reach every parameter)."""
    ids, positions, weights = fixed_batch(vocab_size)
    lp, entropy = policy(ids, positions, 1.0)
    return -(weights * lp).sum() + 0.1 * (weights * entropy).sum()


LORA = LoraConfig(rank=4, alpha=8.0, targets=["q_proj", "v_proj", "o_proj"])


def switches(mode: str | None) -> dict:
    return {None: {}, "fp8": dict(fp8=True), "lora": dict(lora=LORA)}[mode]


@torch.no_grad()
def random_adapters(policy) -> None:
    """Every adapter drawn from one generator, each rank copying its block (B is zero after peft's
    initialisation, so A would have no gradient)."""
    generator = torch.Generator().manual_seed(5)
    for _, param in policy.adapter_parameters():
        local, ranges = _local_block(param)
        local.copy_((torch.randn(param.shape, generator=generator) * 0.1)[tuple(slice(a, b) for a, b in ranges)])


def whole_gradients(policy) -> dict[str, torch.Tensor]:
    return {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for name, p in policy.named_parameters() if p.grad is not None}


def main(model: str, out: str, mode: str | None = None, ep: str = "1") -> None:
    env = init_distributed()
    dims = ParallelDims(tp=env.world_size, ep=int(ep))
    policy = load_titan_model(model, env, "float32", False, 16, dims=dims, **switches(mode))
    if mode == "lora":
        random_adapters(policy)
    loss = loss_of(policy, policy.config.vocab_size)
    loss.backward()
    norm = _grad_norm(policy, 1e9, env, build_meshes(dims, env.world_size, env.rank, env.device.type))
    grads = whole_gradients(policy)  # after _grad_norm: it reduced the Partial gradients of replicated weights
    adapters = adapter_tensors(policy.adapter_parameters())  # what LoRA publishes (a gather of TP's splits)
    if env.rank == 0:
        torch.save({"loss": loss.detach(), "grad_norm": norm, "grads": grads, "adapters": adapters}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
