"""The served weights: an HF folder (or a broadcast state dict in HF naming) read into fresh tensors,
rearranged for the lean forward pass (model.py), never touching weights in use.

FP8 (`load_weights(..., fp8=True)`): every matmul weight of the decoder layers (attention projections,
dense MLPs, routed experts) is quantised into primebuild/kernels/fp8.py's block format (128 x 128 blocks, fp32
scales) when loaded -- at start and at every weight update, which loads through here too -- and each
call quantises its input per 1 x 128 tile. The norms are then *not* folded into those weights (their
scale multiplies the activations instead): quantised is the checkpoint's own weight, as FP8 checkpoints
and vLLM quantise it. Kept in the compute dtype: the embedding, the router (a top-k choice flips on
logit errors far smaller than e4m3's 2^-4 relative step, and changes which weights a token uses: the
mismatch router replay exists to remove) and the lm_head (its logits are the log-probs RL compares;
DeepSeek-V3's FP8 recipe keeps both, and vLLM's fp8 leaves the router gate and lm_head unquantised).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from primebuild.errors import Problem, UserError
from primebuild.kernels.fp8 import FP8_DTYPE, BlockFp8Weight
from primebuild.runtime.weight_sync.fp8_wire import scale_name, scale_shape, split_scales

from .linear import ONEDNN_MAX_PACKED_BYTES, Fp8Linear, Linear, onednn_packing_available
from .model_config import ModelConfig


@dataclass
class LayerWeights:
    """One decoder layer, rearranged for few kernel launches per step (the cost on CPU at small sizes).

    RMSNorm weights are folded into the matmul that follows them (rms(x) * w @ W.T == rms(x) @ (W * w).T),
    the q and k norms become one [heads + kv_heads, head_dim] scale, and the 1/sqrt(head_dim) softmax
    scale is folded into the query heads' part of it (RoPE is linear, so the order does not matter).
    Every norm weight also carries sqrt(its size): the forward normalises to unit length (`_unit`).
    """

    qkv: Linear  # [(heads + 2 * kv_heads) * head_dim, hidden], input norm folded in
    qk_norm: torch.Tensor  # [heads + kv_heads, head_dim]
    o_proj: Linear
    # Dense MLP, or shared-nothing experts for a sparse layer.
    gate_up: Linear | None = None  # [2 * intermediate, hidden], post-attention norm folded in
    down: Linear | None = None  # [hidden, intermediate]
    router: torch.Tensor | None = None  # [experts, hidden], norm folded in
    experts_gate_up: torch.Tensor | None = None  # [experts, 2 * moe_intermediate, hidden], norm folded in
    experts_down: torch.Tensor | None = None  # [experts, hidden, moe_intermediate]
    # FP8: the norm scales multiply the activations (not folded into quantised weights), and each
    # expert's two matrices are block-quantised.
    input_scale: torch.Tensor | None = None  # [hidden]
    post_scale: torch.Tensor | None = None  # [hidden]
    experts_fp8: tuple[list[BlockFp8Weight], list[BlockFp8Weight]] | None = None

    def dense(self) -> list[Linear]:
        return [m for m in (self.qkv, self.o_proj, self.gate_up, self.down) if m is not None]


@dataclass
class ModelWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    lm_head: Linear  # final norm folded in (a separate tensor even when embeddings are tied)

    def pack_for_onednn(self) -> bool:
        """Add oneDNN-packed copies of the dense matmul weights if the model is small enough."""
        dense = [m for layer in self.layers for m in layer.dense()] + [self.lm_head]
        size = sum(m.weight.numel() * m.weight.element_size() for m in dense)
        if size > ONEDNN_MAX_PACKED_BYTES:
            return False
        for m in dense:
            m.pack()
        return True


class _TensorSource:
    """All tensors of the *.safetensors files of a folder, read on demand and tracked for leftovers."""

    def __init__(self, folder: Path):
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise UserError(
                Problem(
                    "no *.safetensors files", file=str(folder), hint="save the model with save_pretrained"
                )
            )
        self._where: dict[str, Path] = {}
        for file in files:
            with safe_open(file, "pt") as handle:
                for key in handle.keys():
                    self._where[key] = file
        self._handles: dict[Path, object] = {}
        self.folder = folder

    def has(self, key: str) -> bool:
        return key in self._where

    def get(self, key: str) -> torch.Tensor:
        if key not in self._where:
            raise UserError(
                Problem(
                    f"tensor {key!r} is missing",
                    file=str(self.folder),
                    hint="is this the right architecture?",
                )
            )
        file = self._where[key]
        if file not in self._handles:
            self._handles[file] = safe_open(file, "pt")
        return self._handles[file].get_tensor(key)


class DictSource:
    """The tensors of a state dict in HF checkpoint naming (what a weight broadcast delivers)."""

    def __init__(self, state: Mapping[str, torch.Tensor], label: str):
        self.state, self.folder = state, label

    def has(self, key: str) -> bool:
        return key in self.state

    def get(self, key: str) -> torch.Tensor:
        if key not in self.state:
            raise UserError(Problem(f"tensor {key!r} is missing", file=self.folder,
                                    hint="the sender's model must have the served architecture"))
        return self.state[key]


class Reader:
    """Checked reads from a tensor source: the shape config.json implies, finite values, in the served
    dtype and on the served device."""

    def __init__(self, source: _TensorSource | DictSource, dtype: torch.dtype, device: torch.device | str):
        self.source, self.dtype, self.device = source, dtype, device

    def has(self, key: str) -> bool:
        return self.source.has(key)

    def get(self, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = self.source.get(key)
        if tensor.dtype == FP8_DTYPE:
            raise UserError(Problem(f"tensor {key!r} arrived in FP8, which this server does not serve",
                                    file=str(self.source.folder),
                                    hint="the trainer sends FP8 only to servers of inference.precision: fp8"))
        if not tensor.is_floating_point():  # an int or bool tensor cast to weights would serve garbage, silently
            raise UserError(Problem(f"tensor {key!r} is {str(tensor.dtype).removeprefix('torch.')}, not a "
                                    "floating-point weight", file=str(self.source.folder)))
        if tuple(tensor.shape) != shape:
            raise UserError(
                Problem(
                    f"tensor {key!r} has shape {tuple(tensor.shape)}, config.json implies {shape}",
                    file=str(self.source.folder),
                )
            )
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise UserError(Problem(f"tensor {key!r} has non-finite values (NaN or inf): refusing to serve them",
                                    file=str(self.source.folder)))
        return tensor.to(device=self.device, dtype=self.dtype)

    def blocks(self, key: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A matmul weight sent already in the FP8 serving format (primebuild/runtime/weight_sync/fp8_wire.py):
        (q, scales) on the served device; None when it came in a float dtype (then it is quantised here)."""
        if not self.has(key) or self.source.get(key).dtype != FP8_DTYPE:
            return None
        q, scales = self.source.get(key), self.source.get(scale_name(key))
        want = scale_shape(key, shape)
        if tuple(q.shape) != shape or tuple(scales.shape) != want or scales.dtype != torch.float32:
            raise UserError(Problem(f"FP8 tensor {key!r} {tuple(q.shape)} with scales {scales.dtype} "
                                    f"{tuple(scales.shape)}: config.json implies {shape} with float32 {want}",
                                    file=str(self.source.folder)))
        if not torch.isfinite(scales).all():  # a NaN or inf weight quantises to a NaN or inf block scale
            raise UserError(Problem(f"tensor {key!r} has non-finite block scales (NaN or inf weights): refusing "
                                    "to serve them", file=str(self.source.folder)))
        return q.to(self.device), scales.to(self.device)

    def fp8_parts(self, keys: list[tuple[str, tuple[int, ...]]]) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The FP8 blocks of checkpoint weights fused into one matmul (each its own part), or None when
        they came in a float dtype."""
        sent = [self.blocks(key, shape) for key, shape in keys]
        if all(b is None for b in sent):
            return None
        if any(b is None for b in sent):
            raise UserError(Problem(f"of {[k for k, _ in keys]} only some arrived in FP8",
                                    file=str(self.source.folder)))
        return sent

    def maybe(self, key: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        return self.get(key, shape) if self.has(key) else None

    def norm_weight(self, key: str, size: int, scale: float = 1.0) -> torch.Tensor:
        """An RMSNorm weight times sqrt(size), folded in fp32: the forward normalises rows to unit
        length (x / |x|, one call fewer than x / rms(x)), and this puts the sqrt(size) back."""
        source_weight = self.get(key, (size,)).to(torch.float32)
        return (source_weight * (size**0.5 * scale)).to(self.dtype)


def load_weights(
    origin: str | Path | Mapping[str, torch.Tensor],
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    fp8: bool = False,
) -> ModelWeights:
    """Read an HF folder (or a state dict in HF naming) into fresh tensors, never touching weights in
    use, fused for the hot path; with `fp8`, the decoder's matmul weights block-quantised (see top)."""
    if isinstance(origin, Mapping):
        source = DictSource(origin, "broadcast weights")
    else:
        source = _TensorSource(Path(origin))
    read = Reader(source, dtype, device)
    layers = [load_layer(read, config, i, fp8) for i in range(config.num_layers)]
    embed, lm_head = _load_embedding_and_head(read, config)
    weights = ModelWeights(embed=embed, layers=layers, lm_head=lm_head)
    if onednn_packing_available(device, dtype):
        weights.pack_for_onednn()
    return weights


def _matmul(weight: torch.Tensor, bias: torch.Tensor | None = None, parts: tuple[int, ...] | None = None, *,
            fp8: bool) -> Linear:
    return Fp8Linear(weight, bias, parts) if fp8 else Linear(weight, bias)


def _sent_fp8(read: Reader, keys: list[tuple[str, tuple[int, ...]]], bias: torch.Tensor | None,
              fp8: bool) -> Fp8Linear | None:
    """The matmul of `keys` (fused in this order) from FP8 blocks as sent, or None when they came in a
    float dtype. FP8 blocks reaching a server that does not serve FP8 are refused (`Reader.get`)."""
    sent = read.fp8_parts(keys) if fp8 else None
    return None if sent is None else Fp8Linear.from_blocks(sent, bias, read.dtype)


def load_layer(read: Reader, c: ModelConfig, i: int, fp8: bool) -> LayerWeights:
    """Decoder layer `i`: attention, then its dense MLP or its experts, with the norms folded in."""
    p = f"model.layers.{i}."
    input_norm = read.norm_weight(p + "input_layernorm.weight", c.hidden_size)
    post_norm = read.norm_weight(p + "post_attention_layernorm.weight", c.hidden_size)
    # FP8 quantises the checkpoint's weights, each on its own blocks (fused ones name their parts): the
    # norm scales then stay on the activations.
    fold_input, fold_post = (1, 1) if fp8 else (input_norm[None, :], post_norm[None, :])
    layer = _load_attention(read, c, p, fold_input, fp8)
    if fp8:
        layer.input_scale, layer.post_scale = input_norm, post_norm
    if c.sparse_layers and c.sparse_layers[i]:
        _load_experts(layer, p + "mlp.", c, read, fp8)
        _fold_experts(layer, c, fold_post, post_norm, fp8)
    else:
        _load_dense_mlp(layer, read, c, p, fold_post, fp8)
    return layer


def _load_attention(read: Reader, c: ModelConfig, p: str, fold_input, fp8: bool) -> LayerWeights:
    """Fused q/k/v projection (input norm folded in), the q and k norms as one scale, the output projection."""
    h, d = c.hidden_size, c.head_dim
    q_out, kv_out = c.num_heads * d, c.num_kv_heads * d
    q_bias = read.maybe(p + "self_attn.q_proj.bias", (q_out,)) if c.attention_bias else None
    qkv_bias = None if q_bias is None else torch.cat(
        [q_bias, read.get(p + "self_attn.k_proj.bias", (kv_out,)), read.get(p + "self_attn.v_proj.bias", (kv_out,))]
    )
    qkv_keys = [(p + "self_attn.q_proj.weight", (q_out, h)), (p + "self_attn.k_proj.weight", (kv_out, h)),
                (p + "self_attn.v_proj.weight", (kv_out, h))]
    qkv = _sent_fp8(read, qkv_keys, qkv_bias, fp8)
    if qkv is None:  # folded in place: a layer loaded while the model is served holds one copy
        qkv_weight = torch.cat([read.get(key, shape) for key, shape in qkv_keys]).mul_(fold_input)
        qkv = _matmul(qkv_weight, qkv_bias, parts=(q_out, kv_out, kv_out), fp8=fp8)
    o_key, o_bias = p + "self_attn.o_proj.weight", read.maybe(p + "self_attn.o_proj.bias", (h,)) if c.attention_bias else None
    o_proj = _sent_fp8(read, [(o_key, (h, q_out))], o_bias, fp8) or _matmul(read.get(o_key, (h, q_out)), o_bias, fp8=fp8)
    return LayerWeights(
        qkv=qkv,
        qk_norm=torch.cat(
            [
                read.norm_weight(p + "self_attn.q_norm.weight", d, d**-0.5).expand(c.num_heads, d),
                read.norm_weight(p + "self_attn.k_norm.weight", d).expand(c.num_kv_heads, d),
            ]
        ),
        o_proj=o_proj,
    )


def _load_dense_mlp(layer: LayerWeights, read: Reader, c: ModelConfig, p: str, fold_post, fp8: bool) -> None:
    h, inter = c.hidden_size, c.intermediate_size
    gate_up_keys = [(p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h))]
    layer.gate_up = _sent_fp8(read, gate_up_keys, None, fp8) or _matmul(
        torch.cat([read.get(key, shape) for key, shape in gate_up_keys]).mul_(fold_post),
        parts=(inter, inter),
        fp8=fp8,
    )
    down_key = p + "mlp.down_proj.weight"
    layer.down = _sent_fp8(read, [(down_key, (h, inter))], None, fp8) or _matmul(read.get(down_key, (h, inter)), fp8=fp8)


def _load_experts(layer: LayerWeights, prefix: str, c: ModelConfig, read: Reader, fp8: bool) -> None:
    h, inter, n = c.hidden_size, c.moe_intermediate_size, c.num_experts
    layer.router = read.get(prefix + "gate.weight", (n, h))
    if fp8 and _load_sent_experts(layer, prefix, c, read):
        return
    if read.has(prefix + "experts.gate_up_proj"):  # transformers-5 fused layout
        layer.experts_gate_up = read.get(prefix + "experts.gate_up_proj", (n, 2 * inter, h))
        layer.experts_down = read.get(prefix + "experts.down_proj", (n, h, inter))
        return
    # Released checkpoints (and save_pretrained) store one module per expert.
    layer.experts_gate_up = torch.stack(
        [
            torch.cat(
                [
                    read.get(f"{prefix}experts.{e}.gate_proj.weight", (inter, h)),
                    read.get(f"{prefix}experts.{e}.up_proj.weight", (inter, h)),
                ]
            )
            for e in range(n)
        ]
    )
    layer.experts_down = torch.stack(
        [read.get(f"{prefix}experts.{e}.down_proj.weight", (h, inter)) for e in range(n)]
    )


def _load_sent_experts(layer: LayerWeights, prefix: str, c: ModelConfig, read: Reader) -> bool:
    """The experts from FP8 blocks as sent (fused 3-D parameters or one module per expert); False when
    they came in a float dtype."""
    h, inter, n, dtype = c.hidden_size, c.moe_intermediate_size, c.num_experts, read.dtype
    fused_gate_up, fused_down = prefix + "experts.gate_up_proj", prefix + "experts.down_proj"
    if read.has(fused_gate_up):
        sent = read.fp8_parts([(fused_gate_up, (n, 2 * inter, h)), (fused_down, (n, h, inter))])
        if sent is None:
            return False
        (gu_q, gu_s), (down_q, down_s) = sent
        gate_up = [BlockFp8Weight.from_blocks(list(zip(gu_q[e].split([inter, inter]),
                                                       split_scales(fused_gate_up, 2 * inter, gu_s[e]), strict=True)),
                                              dtype) for e in range(n)]
        down = [BlockFp8Weight.from_blocks([(down_q[e], down_s[e])], dtype) for e in range(n)]
    else:
        per_expert = [read.fp8_parts([(f"{prefix}experts.{e}.{m}_proj.weight", (h, inter) if m == "down" else (inter, h))
                                      for m in ("gate", "up", "down")]) for e in range(n)]
        if all(sent is None for sent in per_expert):
            return False
        if any(sent is None for sent in per_expert):
            raise UserError(Problem(f"only some experts of {prefix} arrived in FP8", file=str(read.source.folder)))
        gate_up = [BlockFp8Weight.from_blocks(sent[:2], dtype) for sent in per_expert]
        down = [BlockFp8Weight.from_blocks(sent[2:], dtype) for sent in per_expert]
    layer.experts_fp8 = (gate_up, down)
    return True


def _fold_experts(layer: LayerWeights, c: ModelConfig, fold_post, post_norm: torch.Tensor, fp8: bool) -> None:
    """The post-attention norm into the router and the experts' gate/up weights; with FP8 the experts'
    two matrices block-quantised instead (the norm then scales the activations)."""
    layer.router = layer.router * fold_post
    if layer.experts_fp8 is not None:  # sent in FP8 (_load_sent_experts)
        return
    if fp8:
        inter = c.moe_intermediate_size
        layer.experts_fp8 = ([BlockFp8Weight(w, (inter, inter)) for w in layer.experts_gate_up],
                             [BlockFp8Weight(w) for w in layer.experts_down])
        layer.experts_gate_up = layer.experts_down = None
    else:
        layer.experts_gate_up = layer.experts_gate_up * post_norm[None, None, :]


def _load_embedding_and_head(read: Reader, c: ModelConfig) -> tuple[torch.Tensor, Linear]:
    """The embedding, and the lm_head with the final norm folded in (a separate tensor even when tied)."""
    h = c.hidden_size
    embed = read.get("model.embed_tokens.weight", (c.vocab_size, h))
    tied = c.tie_word_embeddings or not read.has("lm_head.weight")
    lm_head = embed if tied else read.get("lm_head.weight", (c.vocab_size, h))
    return embed, Linear(lm_head * read.norm_weight("model.norm.weight", h)[None, :])
