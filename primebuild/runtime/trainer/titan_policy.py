"""The policy on torchtitan's model (titan_model.py): loading from a Hugging Face checkpoint, per-token
log-probs of packed rows, and the weights in Hugging Face naming for publishing.

The same contract as model.Policy, so the RL step (main.py), checkpoints and weight publishing do not
know which engine computes: forward(input_ids, position_ids, temperature) -> (log-probs, entropy).

Loading: the model is built on the meta device, activation checkpointing and FSDP2 are applied, and only
then does each rank allocate its shards and read them: torch.distributed.checkpoint with its Hugging Face
safetensors reader fills the sharded state dict in checkpoint naming, which torchtitan's Qwen3
state-dict adapter maps to and from the model's own (grouped experts included).
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.protocols.module import Module

from primebuild.contracts.trainer import LoraConfig, ParallelDims
from primebuild.kernels.dtypes import DTYPES

from .checkpoint import single_process_is_meant
from .context_parallel import ContextShard
from .model import DistEnv
from .router_replay import TITAN_ROUTER, RouterReplay
from .titan_model import DocumentLayout, titan_config
from .titan_parallelize import apply_block_checkpointing, build_titan_dims, configure, parallelize_titan
from .weight_stream import PublishedWeights


class TitanPolicy(nn.Module):
    """torchtitan's Qwen3 as the trained module (the FSDP root, like model.Policy): log-probs come from
    its final hidden states, `chunk_tokens` at a time, never from the whole [tokens x vocab] logits."""

    def __init__(self, titan: nn.Module, hf_config, adapter: Qwen3StateDictAdapter, chunk_tokens: int,
                 flex_attention: bool):
        super().__init__()
        self.titan = titan
        self.hf_config = hf_config
        self.adapter = adapter
        self.chunk_tokens = chunk_tokens
        self.flex_attention = flex_attention  # torchtitan's FlexAttention (its BlockMask), else DocumentAttention
        self.replay: RouterReplay | None = None  # hooks on torchtitan's routers (load_titan_model)
        self.world_mesh = None  # torchtitan's root mesh when parallelized: it holds its groups (teardown.py)
        # FSDP sums gradients over ranks here (titan_parallelize.py); the hf engine's FSDP averages them
        self.sums_gradients = True

    @property
    def config(self):
        return self.hf_config

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, temperature: float,
                shard: ContextShard | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As model.Policy.forward: [B, T] log-probs and entropies, column t for token t (predicted at
        t-1 of its document); column 0 is 0. With a context-parallel `shard` this rank computes only its
        positions (the shard is the attention's mask: titan_model.DocumentAttention) and fills only the
        columns of `shard.targets`."""
        from primebuild.kernels.logprobs import chunked_token_logprobs

        t = self.titan
        b, n = input_ids.shape
        if shard is None:
            masks = t.get_attention_masks(position_ids) if self.flex_attention else DocumentLayout.of(position_ids)
            ids, positions = input_ids, position_ids
        else:
            masks, ids, positions = shard, input_ids[:, shard.positions], position_ids[:, shard.positions]
        hidden = t.tok_embeddings(ids)
        for layer in t.layers.values():
            hidden = layer(hidden, masks, positions)
        hidden, head = _replicated(t.norm(hidden)), _replicated(t.lm_head.weight)
        if shard is None:
            sources, targets = hidden[:, :-1], torch.arange(1, n, device=input_ids.device)
        else:
            sources, targets = hidden[:, shard.positions + 1 < n], shard.targets
        lp, entropy = chunked_token_logprobs(sources.reshape(-1, hidden.shape[-1]), head,
                                             input_ids[:, targets].reshape(-1), temperature, self.chunk_tokens)
        full_lp = lp.new_zeros(b, n).index_copy(1, targets, lp.view(b, -1))
        full_entropy = entropy.new_zeros(b, n).index_copy(1, targets, entropy.view(b, -1))
        return full_lp, full_entropy

    def published_weights(self, dtype: torch.dtype) -> PublishedWeights:
        return PublishedWeights(self.titan, dtype, self.to_checkpoint_naming)

    def adapter_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """LoRA: (PEFT name, parameter) of each adapter tensor, sorted (titan_lora.py); [] without LoRA."""
        from .titan_lora import adapter_parameters

        return adapter_parameters(self.titan)

    def base_numel(self) -> int:
        """Elements of the base model's parameters (adapters excluded)."""
        from .titan_lora import is_titan_adapter

        return sum(p.numel() for n, p in self.titan.named_parameters() if not is_titan_adapter(n))

    def to_checkpoint_naming(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A group of the model's tensors in the checkpoint's names. A tied head is published under its
        own name too (weight_stream.py says why)."""
        out = self.adapter.to_hf(tensors)
        if self.titan.enable_weight_tying and "model.embed_tokens.weight" in out:
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
        return out


def _init_buffers(module: Module, device: torch.device) -> None:
    """Recompute `module`'s buffers on `device`, keeping the DTensor layout TP gave them: torchtitan's
    initialiser assigns plain tensors, and a plain RoPE cache indexed by DTensor positions fails. A Partial
    buffer (a MoE's token counts under TP with EP: each TP rank counts its own tokens) starts at zero on
    every rank, the sum's identity."""
    before = dict(module._buffers)
    module._init_self_buffers(buffer_device=device)
    for name, old in before.items():
        new = module._buffers[name]
        if isinstance(old, DTensor) and not isinstance(new, DTensor):
            assert all(p.is_replicate() or (p.is_partial() and not new.any()) for p in old.placements), \
                (name, old.placements)
            module._buffers[name] = DTensor.from_local(new, old.device_mesh, old.placements, run_check=False)


def _replicated(x: torch.Tensor) -> torch.Tensor:
    """Under TP, the final norm's output is split along the sequence and the head along the vocabulary
    (torchtitan's plan): the log-probs kernel takes them whole (gathered, differentiably). Otherwise
    unchanged. A vocab-parallel log-softmax would keep the head split; not built: the plan's memory
    model counts the whole head's logits chunk."""
    return x.full_tensor() if isinstance(x, DTensor) else x


def load_titan_model(model_path: str, env: DistEnv, compute_dtype: str, activation_checkpointing: bool,
                     logprob_chunk_tokens: int, dims: ParallelDims | None = None,
                     cpu_offload: bool = False, router_replay: bool = False, fp8: bool = False,
                     lora: LoraConfig | None = None, seed: int = 0) -> TitanPolicy:
    """torchtitan's Qwen3 for the checkpoint at `model_path`: fp32 master weights, computed in
    `compute_dtype` (FSDP's mixed precision, or autocast on one rank: model.autocast_context), laid out
    over the ranks by `dims` (titan_parallelize.py), each rank holding only its shards from the start.
    With `router_replay` the routers replay recorded routes (router_replay.py; hooked at their output,
    before the token dispatcher, so with expert parallelism too). `fp8` switches the blocks' linear layers
    and experts to FP8 forwards (titan_fp8.py); `lora` adds adapters and freezes the base (titan_lora.py):
    both on the meta model, before activation checkpointing and FSDP."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    dims = dims or ParallelDims(dp_shard=env.world_size)
    flex = env.device.type == "cuda" and dims.cp == 1  # CP: DocumentAttention (titan_model.py says why)
    model_config = titan_config(config, flex, exact_experts=compute_dtype == "float32")
    if env.distributed:
        configure(model_config, dims)
    with torch.device("meta"):
        titan = model_config.build()
    # no hf_assets_path: the adapter would look for an index of shards only a save in HF layout uses
    policy = TitanPolicy(titan, config, Qwen3StateDictAdapter(model_config, None), logprob_chunk_tokens, flex)
    if fp8:
        from .titan_fp8 import apply_titan_fp8

        apply_titan_fp8(titan)
    if lora is not None:
        from .titan_lora import apply_titan_lora

        apply_titan_lora(titan, policy.adapter.from_hf_map, lora)
    titan_dims = build_titan_dims(dims, env.world_size, env.device.type) if env.distributed else None
    if titan_dims is not None:
        policy.world_mesh = titan_dims.world_mesh
        parallelize_titan(policy, titan, titan_dims, DTYPES[compute_dtype], activation_checkpointing, cpu_offload)
    elif activation_checkpointing:
        apply_block_checkpointing(titan)
    policy.to_empty(device="cpu" if cpu_offload else env.device)
    if titan.enable_weight_tying and not env.distributed:
        # to_empty gave the head and the embedding a tensor each; FSDP2 keeps shared parameters shared
        titan.tok_embeddings.weight = titan.lm_head.weight
    for module in titan.modules():  # computed buffers (RoPE caches) are not in the checkpoint
        if isinstance(module, Module) and module._buffers:
            _init_buffers(module, env.device)
    load_hf_weights(policy, model_path)
    if lora is not None:
        from .lora import init_adapters

        init_adapters(policy.adapter_parameters(), seed)
    if router_replay:
        policy.replay = RouterReplay(titan, TITAN_ROUTER)
    policy.train()
    return policy


@torch.no_grad()
def load_hf_weights(policy: TitanPolicy, model_path: str) -> None:
    """Fill every rank's shards from the safetensors at `model_path` (names mapped by the adapter)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    sharded = policy.titan.state_dict()
    wanted = policy.adapter.to_hf(sharded)
    with single_process_is_meant():  # a one-rank trainer
        dcp.load(wanted, storage_reader=HuggingFaceStorageReader(model_path))
    # LoRA's adapters are not in the checkpoint (the adapter's map skips them): init_adapters fills them
    missing, unexpected = policy.titan.load_state_dict(policy.adapter.from_hf(wanted), strict=False)
    from .titan_lora import is_titan_adapter

    if unexpected or any(not is_titan_adapter(name) for name in missing):
        raise RuntimeError(f"{model_path}: not loaded into torchtitan's model: {[n for n in missing if not is_titan_adapter(n)]}"
                           f"; not the model's: {unexpected}")
