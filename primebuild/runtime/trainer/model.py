"""The policy model: loading (parallelized by parallelize.py), per-token log-probs, and the full weights for
publishing."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from primebuild.contracts.dtypes import PRECISION_DTYPES
from primebuild.contracts.trainer import LoraConfig, ParallelDims
from primebuild.kernels.dtypes import DTYPES

from .context_parallel import ContextShard, ContextSplit
from .lora import apply_lora, init_adapters
from .parallel_dims import Meshes, build_meshes
from .parallelize import Parallelism, parallelize
from .router_replay import RouterReplay
from .sparse_attention import apply_chunked_indexer


def precision_dtype(precision: str, device: torch.device) -> str:
    """The compute dtype of a trainer precision; fp8 computes its FP8 matmuls inside it (fp8.py): bf16 on
    GPUs, fp32 on CPUs (no faster in bf16, and where FP8 is the fp32 reference function anyway)."""
    if precision == "fp8":
        return "bfloat16" if device.type == "cuda" else "float32"
    return PRECISION_DTYPES[precision]


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed() -> DistEnv:
    """Join the torchrun job if there is one (nccl on CUDA, gloo on CPU); one process needs no group."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    return DistEnv(rank=rank, world_size=world_size, device=device)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The stack of transformer blocks (``model.model.layers`` for Qwen3 / Qwen3-MoE / Llama-likes)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__}: no model.layers ModuleList to shard per block")
    return layers


class Policy(nn.Module):
    """The trained module: an HF causal LM whose per-token log-probs come from its last hidden states,
    `chunk_tokens` at a time (primebuild/kernels/logprobs.py), never from the whole [tokens x vocab] logits.

    It is the FSDP root, so the head, embeddings and final norm are unsharded for its forward and
    their gradients are reduced like every other's."""

    # FSDP2 averages gradients over ranks here (train_step scales the loss back); titan_policy's sums them
    sums_gradients = False

    def __init__(self, hf: nn.Module, chunk_tokens: int, router_replay: bool = False):
        super().__init__()
        head = hf.get_output_embeddings()
        if getattr(head, "bias", None) is not None or getattr(hf.config, "final_logit_softcapping", None):
            raise ValueError(f"{type(hf).__name__}: its head is more than one linear map (bias or soft-capping)")
        self.hf = hf
        self.chunk_tokens = chunk_tokens
        # hooks on the routers, inert outside `replay.replaying(routes)` (router_replay.py)
        self.replay = RouterReplay(hf) if router_replay else None
        # the micro-batch's split under CP, read by the attention modules (parallelize.py); None without CP
        self.context_split: ContextSplit | None = None

    @property
    def config(self):
        return self.hf.config

    def published_weights(self, dtype: torch.dtype):
        """The full weights in the checkpoint's naming, a layer at a time (weight_stream.py)."""
        from .weight_stream import PublishedWeights

        return PublishedWeights(self.hf, dtype)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, temperature: float,
                shard: ContextShard | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-prob of every token given its prefix in its document, and the policy's entropy there (no
        gradient).

        `input_ids` is a packed row (batch.py): `position_ids` restart at 0 where a document starts, and
        attention stays within documents. Both outputs are [B, T] and aligned with `input_ids`: column t
        describes token t, predicted at t-1; column 0 has no prediction and is 0 (a document's first
        column is predicted from the document before it: no loss reads it). Logits are divided by the
        sampling temperature so that the trainer scores the same distribution the inference server
        sampled from.

        With a context-parallel `shard` this rank computes only its positions and fills only the columns
        of `shard.targets` (the others stay 0: another CP rank scores them)."""
        from primebuild.kernels.logprobs import chunked_token_logprobs

        b, t = input_ids.shape
        if self.context_split is not None:
            self.context_split.shard = shard
        if shard is None:
            # no attention_mask and no cache: transformers then builds the block-causal document mask from
            # the positions (with a cache it skips that and attends across documents)
            hidden = self.hf.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
            sources, targets = hidden[:, :-1], torch.arange(1, t, device=input_ids.device)
        else:
            positions = shard.positions
            hidden = self.hf.model(input_ids=input_ids[:, positions], position_ids=position_ids[:, positions],
                                   use_cache=False).last_hidden_state
            sources, targets = hidden[:, positions + 1 < t], shard.targets
        h = hidden.shape[-1]
        lp, entropy = chunked_token_logprobs(sources.reshape(-1, h), self.hf.get_output_embeddings().weight,
                                             input_ids[:, targets].reshape(-1), temperature, self.chunk_tokens)
        full_lp = lp.new_zeros(b, t).index_copy(1, targets, lp.view(b, -1))
        full_entropy = entropy.new_zeros(b, t).index_copy(1, targets, entropy.view(b, -1))
        return full_lp, full_entropy


def load_model(model_path: str, env: DistEnv, compute_dtype: str, activation_checkpointing: bool,
               logprob_chunk_tokens: int, router_replay: bool = False, fp8: bool = False,
               meshes: Meshes | None = None, cpu_offload: bool = False, lora: LoraConfig | None = None,
               seed: int = 0) -> Policy:
    """Build the HF causal LM on the meta device with fp32 master weights, apply FP8, activation
    checkpointing and the parallel dimensions of `meshes` (parallelize.py), and only then allocate each
    rank's shards and read them from the checkpoint (sharded_load.py): no rank ever holds the full model.
    Parameters are computed in ``compute_dtype``; gradients are reduced in fp32. `cpu_offload` keeps
    the sharded parameters, gradients and with them the optimizer state in host memory (FSDP2's
    CPUOffloadPolicy): only the gathered layers, the activations and the logits occupy the device, and
    the optimizer steps on the CPU (FSDP only: one rank has no shards; the trainer's check_launch
    refuses it there). With `lora`, adapters are injected before any of that and only they train (lora.py)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .sharded_load import init_computed_buffers, load_shards

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    hf.config.use_cache = False
    if lora is not None:  # on the meta model, before FSDP wraps the blocks (lora.py)
        apply_lora(hf, lora)
    apply_chunked_indexer(hf)  # DSA models: bounded index scores, with or without CP (sparse_attention.py)
    model = Policy(hf, logprob_chunk_tokens, router_replay)
    if env.distributed:
        meshes = meshes or build_meshes(ParallelDims(dp_shard=env.world_size), env.world_size, env.rank,
                                        env.device.type)
    parallelize(model, decoder_layers(hf), Parallelism(DTYPES[compute_dtype], meshes if env.distributed else None,
                                                       fp8, activation_checkpointing, cpu_offload))
    # offloaded shards live in host memory; FSDP2 moves what it gathers to the device
    model.to_empty(device="cpu" if cpu_offload else env.device)
    if not env.distributed:
        hf.tie_weights()  # to_empty gave each module its own tensor; FSDP2 keeps shared parameters shared
    load_shards(hf, model_path)
    init_computed_buffers(hf)
    if lora is not None:
        init_adapters(hf, seed)
    if cpu_offload:  # buffers (rotary frequencies) are not FSDP's: they stay where the compute is
        for module in hf.modules():
            for name, buffer in module.named_buffers(recurse=False):
                module._buffers[name] = buffer.to(env.device)
    model.train()
    return model


def autocast_context(env: DistEnv, compute_dtype: str):
    """One rank has no FSDP mixed-precision policy; autocast gives it the same fp32-master/bf16-compute
    split. With FSDP (or fp32) this is a no-op."""
    enabled = compute_dtype != "float32" and not env.distributed
    return torch.autocast(env.device.type, dtype=DTYPES[compute_dtype], enabled=enabled)


def full_state_dict(policy: Policy, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All full (unsharded) weights on CPU, in HF checkpoint naming and ``dtype`` (weight_stream.py),
    in one dict: for tests and tools on small models; the trainer publishes them streamed instead.
    Every rank must call it (it is a collective); ranks other than 0 get an empty dict."""
    weights = policy.published_weights(dtype)
    if dist.is_initialized() and dist.get_rank() != 0:
        weights.drain()
        return {}
    return {name: tensor for group in weights.groups() for name, tensor in group}
