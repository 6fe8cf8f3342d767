"""A lean Qwen3 / Qwen3-MoE forward pass in plain torch, over the weights of an HF model folder.

Why not call the HF modules: on small models `generate` spends most of its time in Python module
overhead (norm modules, config look-ups, mask building), not in matmuls. Here one decoder layer is a
couple of dozen torch calls: fused QKV and gate/up projections (oneDNN-packed for calls with many
rows, see `Linear`), unit-length norms with the norm weights folded into the next matmul, a
precomputed RoPE table and attention over a preallocated KV cache (see kv_cache.py). The HF model code stays the reference that the
tests compare against, token for token and log-prob for log-prob.

Only inference: no autograd, no dropout. Supported: `model_type` qwen3 and qwen3_moe with default RoPE
and full attention (what every released Qwen3 checkpoint uses).

FP8 (`load_weights(..., fp8=True)`): every matmul weight of the decoder layers (attention projections,
dense MLPs, routed experts) is quantised into kernels/fp8.py's block format (128 x 128 blocks, fp32
scales) when loaded -- at start and at every weight update, which loads through here too -- and each
call quantises its input per 1 x 128 tile. The norms are then *not* folded into those weights (their
scale multiplies the activations instead): quantised is the checkpoint's own weight, as FP8 checkpoints
and vLLM quantise it. Kept in the compute dtype: the embedding, the router (a top-k choice flips on
logit errors far smaller than e4m3's 2^-4 relative step, and changes which weights a token uses: the
mismatch router replay exists to remove) and the lm_head (its logits are the log-probs RL compares;
DeepSeek-V3's FP8 recipe keeps both, and vLLM's fp8 leaves the router gate and lm_head unquantised).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from primebuild.contracts.inference import EMBEDDED_MODEL_TYPES
from primebuild.errors import Problem, UserError
from primebuild.json_file import read_json
from primebuild.kernels.fp8 import BlockFp8Weight, fake_quantize_activation

SUPPORTED_MODEL_TYPES = EMBEDDED_MODEL_TYPES


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the forward pass needs, read from an HF `config.json`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    # Mixture of experts (num_experts == 0 for dense models).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[bool, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_hf(cls, raw: dict, source: str) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UserError(
                Problem(
                    f"model_type {model_type!r} is not supported by the embedded engine",
                    file=source,
                    field="model_type",
                    hint=f"use one of {', '.join(SUPPORTED_MODEL_TYPES)}, or the vLLM backend",
                )
            )
        if raw.get("use_sliding_window"):
            raise UserError(
                Problem(
                    "sliding-window attention is not supported by the embedded engine",
                    file=source,
                    field="use_sliding_window",
                    hint="set it to false (released Qwen3 checkpoints do not use it)",
                )
            )
        # transformers 5 writes `rope_parameters`; older configs and released checkpoints `rope_theta`.
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise UserError(
                Problem(
                    f"RoPE type {rope_type!r} is not supported by the embedded engine",
                    file=source,
                    field="rope_parameters.rope_type",
                    hint="only default RoPE is implemented",
                )
            )
        rope_theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        try:
            num_heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            num_layers = int(raw["num_hidden_layers"])
            num_experts = int(raw.get("num_experts", raw.get("num_local_experts", 0)) or 0)
            sparse_step = int(raw.get("decoder_sparse_step", 1) or 1)
            mlp_only = set(raw.get("mlp_only_layers") or [])
            sparse = tuple(
                model_type == "qwen3_moe"
                and num_experts > 0
                and i not in mlp_only
                and (i + 1) % sparse_step == 0
                for i in range(num_layers)
            )
            return cls(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                num_layers=num_layers,
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=int(raw.get("head_dim") or hidden // num_heads),
                intermediate_size=int(raw["intermediate_size"]),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", False)),
                num_experts=num_experts if model_type == "qwen3_moe" else 0,
                num_experts_per_tok=int(raw.get("num_experts_per_tok", 0) or 0),
                moe_intermediate_size=int(raw.get("moe_intermediate_size", 0) or 0),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                sparse_layers=sparse,
            )
        except KeyError as missing:
            raise UserError(
                Problem(f"required field {missing} is missing", file=source, field=str(missing).strip("'"))
            ) from None

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise UserError(
                Problem(
                    "no config.json: not an HF model folder",
                    file=str(path),
                    hint="point --model at a folder holding config.json, *.safetensors and tokenizer.json",
                )
            )
        return cls.from_hf(read_json(path, what="config.json"), str(path))

    def shape_signature(self) -> tuple:
        """Everything that fixes tensor shapes: two folders with equal signatures can swap weights."""
        return (
            self.model_type,
            self.vocab_size,
            self.hidden_size,
            self.num_layers,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.intermediate_size,
            self.num_experts,
            self.num_experts_per_tok,
            self.moe_intermediate_size,
            self.sparse_layers,
            self.tie_word_embeddings,
            self.attention_bias,
        )


# oneDNN's fp32 GEMM on packed weights beats the MKL GEMM that F.linear calls by 1.5-2.5x once a
# matmul has a few rows (measured on an AVX-512 EPYC, where MKL takes its generic path); for a single
# row, or a small weight and few rows, its fixed ~10 us call cost loses. Measured inside the decode
# step, the crossover sat near 2^21 multiply-adds per call (tiny model: from 16-128 rows depending on
# the matrix; a 20M model: from 2-8 rows).
ONEDNN_MIN_MACS = 1 << 21
# Packed copies double the dense weights in memory: only small models (where call overheads matter
# most) get them, and only fp32 on CPU (bf16 matmuls already go through oneDNN).
ONEDNN_MAX_PACKED_BYTES = 1 << 30


def onednn_packing_available(device, dtype: torch.dtype) -> bool:
    return (
        torch.device(device).type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class Linear:
    """A weight [out, in] (+ bias) and, optionally, a oneDNN-packed copy used for calls with many rows."""

    __slots__ = ("weight", "weight_t", "bias", "packed", "packed_from_rows")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight.contiguous()
        self.weight_t = self.weight.t()  # a view, kept to save a call per matmul
        self.bias = bias
        self.packed = None
        self.packed_from_rows = 1 << 62

    def pack(self, batch_hint: int = 64) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, batch_hint)
        self.packed_from_rows = max(2, -(-ONEDNN_MIN_MACS // self.weight.numel()))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] -> [rows, out]."""
        if x.shape[0] >= self.packed_from_rows:
            return _onednn_linear(x, self.packed, self.bias, "none", [], "")
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + x @ weight.T (+ bias), the add fused into the matmul; 2-D operands."""
        if x.shape[0] >= self.packed_from_rows:
            return _onednn_linear_add(x, residual, self.packed, self.bias, "add")
        if self.bias is None:
            return torch.addmm(residual, x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t).add_(residual)


class Fp8Linear(Linear):
    """A Linear whose weight is held in FP8 blocks and whose input is quantised per 1x128 tile at every
    call: on a GPU with the block-scaled GEMM through cuBLAS, elsewhere as the fp32 product of the
    rounded input and the dequantised weight (kernels/fp8.py, `BlockFp8Weight`), which also takes the
    packed oneDNN path for many rows."""

    __slots__ = ("fp8",)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, parts: tuple[int, ...] | None = None):
        self.fp8 = BlockFp8Weight(weight, parts)  # parts: the checkpoint weights fused here, each its own blocks
        super().__init__(self.fp8.dequantised.to(weight.dtype), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8.fast:
            y = self.fp8.matmul(x)
            return y if self.bias is None else y + self.bias
        return super().__call__(fake_quantize_activation(x))

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.fp8.fast:
            return residual + self(x)
        return super().add_to(residual, fake_quantize_activation(x))


if hasattr(torch.ops.mkldnn, "_linear_pointwise"):
    _onednn_linear = torch.ops.mkldnn._linear_pointwise.default
    _onednn_linear_add = torch.ops.mkldnn._linear_pointwise.binary


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


class _DictSource:
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
        source = _DictSource(origin, "broadcast weights")
    else:
        source = _TensorSource(Path(origin))
    folder = source.folder

    def get(key: str, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = source.get(key)
        if tuple(tensor.shape) != shape:
            raise UserError(
                Problem(
                    f"tensor {key!r} has shape {tuple(tensor.shape)}, config.json implies {shape}",
                    file=str(folder),
                )
            )
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise UserError(Problem(f"tensor {key!r} has non-finite values (NaN or inf): refusing to serve them",
                                    file=str(folder)))
        return tensor.to(device=device, dtype=dtype)

    def maybe(key: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        return get(key, shape) if source.has(key) else None

    def norm_weight(key: str, size: int, scale: float = 1.0) -> torch.Tensor:
        """An RMSNorm weight times sqrt(size), folded in fp32: the forward normalises rows to unit
        length (x / |x|, one call fewer than x / rms(x)), and this puts the sqrt(size) back."""
        source_weight = get(key, (size,)).to(torch.float32)
        return (source_weight * (size**0.5 * scale)).to(dtype)

    c = config
    h, d = c.hidden_size, c.head_dim
    q_out, kv_out = c.num_heads * d, c.num_kv_heads * d
    layers = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        input_norm = norm_weight(p + "input_layernorm.weight", h)
        post_norm = norm_weight(p + "post_attention_layernorm.weight", h)
        q_bias = maybe(p + "self_attn.q_proj.bias", (q_out,)) if c.attention_bias else None
        # FP8 quantises the checkpoint's weights, each on its own blocks (fused ones name their parts): the
        # norm scales then stay on the activations.
        fold_input, fold_post = (1, 1) if fp8 else (input_norm[None, :], post_norm[None, :])

        def matmul(weight, bias=None, parts=None):
            return Fp8Linear(weight, bias, parts) if fp8 else Linear(weight, bias)

        layer = LayerWeights(
            qkv=matmul(
                torch.cat(
                    [
                        get(p + "self_attn.q_proj.weight", (q_out, h)),
                        get(p + "self_attn.k_proj.weight", (kv_out, h)),
                        get(p + "self_attn.v_proj.weight", (kv_out, h)),
                    ]
                )
                * fold_input,
                None
                if q_bias is None
                else torch.cat(
                    [
                        q_bias,
                        get(p + "self_attn.k_proj.bias", (kv_out,)),
                        get(p + "self_attn.v_proj.bias", (kv_out,)),
                    ]
                ),
                parts=(q_out, kv_out, kv_out),
            ),
            qk_norm=torch.cat(
                [
                    norm_weight(p + "self_attn.q_norm.weight", d, d**-0.5).expand(c.num_heads, d),
                    norm_weight(p + "self_attn.k_norm.weight", d).expand(c.num_kv_heads, d),
                ]
            ),
            o_proj=matmul(
                get(p + "self_attn.o_proj.weight", (h, q_out)),
                maybe(p + "self_attn.o_proj.bias", (h,)) if c.attention_bias else None,
            ),
        )
        if fp8:
            layer.input_scale, layer.post_scale = input_norm, post_norm
        if c.sparse_layers and c.sparse_layers[i]:
            _load_experts(layer, p + "mlp.", c, get, source)
            layer.router = layer.router * fold_post
            if fp8:
                inter = c.moe_intermediate_size
                layer.experts_fp8 = ([BlockFp8Weight(w, (inter, inter)) for w in layer.experts_gate_up],
                                     [BlockFp8Weight(w) for w in layer.experts_down])
                layer.experts_gate_up = layer.experts_down = None
            else:
                layer.experts_gate_up = layer.experts_gate_up * post_norm[None, None, :]
        else:
            inter = c.intermediate_size
            layer.gate_up = matmul(
                torch.cat(
                    [get(p + "mlp.gate_proj.weight", (inter, h)), get(p + "mlp.up_proj.weight", (inter, h))]
                )
                * fold_post,
                parts=(inter, inter),
            )
            layer.down = matmul(get(p + "mlp.down_proj.weight", (h, inter)))
        layers.append(layer)
    embed = get("model.embed_tokens.weight", (c.vocab_size, h))
    tied = c.tie_word_embeddings or not source.has("lm_head.weight")
    lm_head = embed if tied else get("lm_head.weight", (c.vocab_size, h))
    lm_head = Linear(lm_head * norm_weight("model.norm.weight", h)[None, :])
    weights = ModelWeights(embed=embed, layers=layers, lm_head=lm_head)
    if onednn_packing_available(device, dtype):
        weights.pack_for_onednn()
    return weights


def _load_experts(layer: LayerWeights, prefix: str, c: ModelConfig, get, source: _TensorSource) -> None:
    h, inter, n = c.hidden_size, c.moe_intermediate_size, c.num_experts
    layer.router = get(prefix + "gate.weight", (n, h))
    if source.has(prefix + "experts.gate_up_proj"):  # transformers-5 fused layout
        layer.experts_gate_up = get(prefix + "experts.gate_up_proj", (n, 2 * inter, h))
        layer.experts_down = get(prefix + "experts.down_proj", (n, h, inter))
        return
    # Released checkpoints (and save_pretrained) store one module per expert.
    layer.experts_gate_up = torch.stack(
        [
            torch.cat(
                [
                    get(f"{prefix}experts.{e}.gate_proj.weight", (inter, h)),
                    get(f"{prefix}experts.{e}.up_proj.weight", (inter, h)),
                ]
            )
            for e in range(n)
        ]
    )
    layer.experts_down = torch.stack(
        [get(f"{prefix}experts.{e}.down_proj.weight", (h, inter)) for e in range(n)]
    )


class RotaryTable:
    """cos/sin for every position, computed once exactly as HF's default RoPE does (fp32, then cast)."""

    def __init__(self, config: ModelConfig, max_len: int, dtype: torch.dtype, device):
        d = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        freqs = torch.arange(max_len, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        # HF rotates with cat(-x2, x1) * sin; we use roll(x) = cat(x2, x1) times cat(-sin, sin): same bits.
        half = d // 2
        sin = emb.sin()
        sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
        # [max_len, 2, D]: a decode step gathers cos and sin of every row's position in one call.
        self.cos_sin = torch.stack([emb.cos(), sin_signed], dim=1).to(device=device, dtype=dtype)
        self.cos = self.cos_sin[:, 0]
        self.sin_signed = self.cos_sin[:, 1]


@functools.lru_cache(maxsize=64)
def _norm_floor(square: float, device: torch.device) -> torch.Tensor:
    """sqrt(n * eps) as a tensor, for `torch.hypot` (which takes no Python scalar)."""
    return torch.tensor(square**0.5, dtype=torch.float32, device=device)


def _unit(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(|x|^2 + n * eps) over the last axis (size n): RMSNorm divided by sqrt(n). In fp32 it
    is x / hypot(|x|, sqrt(n * eps)), 3 calls where F.rms_norm takes 7 kernels on CPU (and half the
    time of vecdot + add + rsqrt + unsqueeze + mul). The sqrt(n) lives in the weights (`norm_weight`).
    Half-precision inputs are reduced in fp32, as HF's Qwen3RMSNorm does."""
    if x.dtype != torch.float32:
        wide = x.float()
        return (wide * torch.linalg.vecdot(wide, wide).add_(x.shape[-1] * eps).rsqrt_()[..., None]).to(
            x.dtype
        )
    floor = _norm_floor(x.shape[-1] * eps, x.device)
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).hypot_(floor)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), sin_signed)


class Qwen3Forward:
    """Forward passes over one set of weights; `weights` may be swapped between calls.

    The decode step is written for the CPU, where a tiny model's step costs about as much in per-call
    overhead (a few microseconds per torch call) as in arithmetic: every call it makes is counted, and
    shapes are arranged so that no call hides a copy (see `decode`).
    """

    def __init__(self, config: ModelConfig, weights: ModelWeights, rope: RotaryTable):
        self.config = config
        self.weights = weights
        self.rope = rope
        c = config
        self._split = ((c.num_heads + c.num_kv_heads) * c.head_dim, c.num_kv_heads * c.head_dim)
        self._heads = (c.num_heads, c.num_kv_heads)
        device = rope.cos_sin.device
        self._arange = torch.arange(rope.cos_sin.shape[0], device=device)
        self._minus_inf = torch.tensor(float("-inf"), dtype=rope.cos_sin.dtype, device=device)
        self._zero = torch.zeros((), dtype=rope.cos_sin.dtype, device=device)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm without its weight and its sqrt(hidden) (both folded into the next matmul)."""
        return _unit(x, self.config.rms_norm_eps)

    def _input_norm(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        normed = self._norm(x)
        return normed if layer.input_scale is None else normed * layer.input_scale

    def _qkv(self, layer: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Normed input [N, hidden] -> q (pre-scaled) and k with q/k norm and RoPE applied, [N, heads, D]
        each, and v [N, kv_heads, D] (a view into the projection's output)."""
        c = self.config
        qk, v = layer.qkv(x).split_with_sizes(self._split, dim=-1)
        qk = _unit(qk.view(x.shape[0], -1, c.head_dim), c.rms_norm_eps)
        q, k = _rotate(qk * layer.qk_norm, cos, sin).split_with_sizes(self._heads, dim=-2)
        return q, k, v.view(x.shape[0], c.num_kv_heads, c.head_dim)

    def _mlp(self, layer: LayerWeights, x: torch.Tensor, routed: list | None) -> torch.Tensor:
        """x + MLP(norm(x)) for 2-D x; a dense MLP's down projection carries the residual add."""
        normed = self._norm(x)
        if layer.post_scale is not None:  # FP8: the norm's weight is not folded into quantised weights
            normed = normed * layer.post_scale
        if layer.router is None:
            gate, up = layer.gate_up(normed).chunk(2, dim=-1)
            return layer.down.add_to(x, F.silu(gate).mul_(up))
        return x + self._moe(layer, normed, routed)

    def _moe(self, layer: LayerWeights, flat: torch.Tensor, routed: list | None) -> torch.Tensor:
        c = self.config
        router_logits = F.linear(flat, layer.router)
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        top_weights, top_experts = torch.topk(probs, c.num_experts_per_tok, dim=-1)
        if c.norm_topk_prob:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        top_weights = top_weights.to(flat.dtype)
        if routed is not None:
            routed.append(top_experts)
        # Group (token, slot) pairs by expert so that each expert runs one matmul over its tokens.
        by_expert = top_experts.flatten()
        order = torch.argsort(by_expert, stable=True)
        counts = torch.bincount(by_expert, minlength=c.num_experts).tolist()
        token_of = order // c.num_experts_per_tok
        weight_of = top_weights.flatten()[order]
        if layer.experts_fp8 is not None:
            return self._moe_fp8(layer, flat, counts, token_of, weight_of)
        out = torch.zeros_like(flat)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            tokens = token_of[start : start + count]
            gate, up = F.linear(flat[tokens], layer.experts_gate_up[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, layer.experts_down[expert])
            out.index_add_(0, tokens, y * weight_of[start : start + count, None])
            start += count
        return out

    def _moe_fp8(self, layer: LayerWeights, flat: torch.Tensor, counts: list[int], token_of: torch.Tensor,
                 weight_of: torch.Tensor) -> torch.Tensor:
        """The experts with FP8 weights. Quantisation is per token and 1x128 tile, so the tokens' inputs
        are quantised once for every expert, and on the reference path the inner activations of all
        experts at once (3 quantisations per layer instead of 1 + 2 per expert)."""
        gate_up, down = layer.experts_fp8
        reference = not gate_up[0].fast
        source = fake_quantize_activation(flat.float()) if reference else flat  # reference: fp32 sums
        inner, ranges, start = [], [], 0
        for expert, count in enumerate(counts):
            if count:
                rows = token_of[start : start + count]
                w = gate_up[expert]
                g, u = (source[rows] @ w.dequantised.T if reference else w.matmul(source[rows])).chunk(2, dim=-1)
                inner.append(F.silu(g) * u)
                ranges.append((expert, start, count))
            start += count
        if reference:
            inner = fake_quantize_activation(torch.cat(inner)).split([n for _, _, n in ranges])
        out = torch.zeros_like(flat)
        for h, (expert, start, count) in zip(inner, ranges, strict=True):
            w = down[expert]
            y = (h @ w.dequantised.T if reference else w.matmul(h)).to(flat.dtype)
            out.index_add_(0, token_of[start : start + count], y * weight_of[start : start + count, None])
        return out

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.weights.lm_head(self._norm(hidden)).float()

    @torch.inference_mode()
    def prefill(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        slots: torch.Tensor,
        cache,
        routed: list | None = None,
    ) -> torch.Tensor:
        """Right-padded prompts [B, T] from position 0 into cache `slots`; logits [B, V] at each last token.

        Padding sits after the real tokens, so causal attention never lets a real token see it; the
        padding's K/V written beyond a sequence's length is masked out later and then overwritten.
        Matmuls run over the flattened [B * T, hidden] rows.
        """
        c = self.config
        w = self.weights
        batch, steps = tokens.shape
        rows = batch * steps
        cos = self.rope.cos[:steps].repeat(batch, 1)[:, None, :]  # [B * T, 1, D]
        sin = self.rope.sin_signed[:steps].repeat(batch, 1)[:, None, :]
        x = F.embedding(tokens.flatten(), w.embed)
        for index, layer in enumerate(w.layers):
            q, k, v = self._qkv(layer, self._input_norm(layer, x), cos, sin)  # [B * T, heads, D]
            q = q.view(batch, steps, c.num_heads, c.head_dim).transpose(1, 2)
            k = k.view(batch, steps, c.num_kv_heads, c.head_dim).transpose(1, 2)
            v = v.view(batch, steps, c.num_kv_heads, c.head_dim).transpose(1, 2)
            cache.k[index][slots, :, :steps] = k
            cache.v[index][slots, :, :steps] = v
            attn = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=1.0, enable_gqa=c.num_kv_heads != c.num_heads
            )
            x = layer.o_proj.add_to(x, attn.transpose(1, 2).reshape(rows, -1))
            x = self._mlp(layer, x, routed)
        if routed is not None:
            routed[:] = [r.view(batch, steps, -1) for r in routed]
        last = x.view(batch, steps, -1)[torch.arange(batch, device=x.device), lengths - 1]
        return self._logits(last)

    @torch.inference_mode()
    def decode(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache, max_len: int, routed: list | None = None
    ) -> torch.Tensor:
        """One new token per sequence; sequence b lives in cache slot b (the cache keeps them packed).

        Per layer: norm, fused QKV matmul, q/k norm and RoPE (4 calls), two K/V row writes, attention,
        and the output projection and down projection each carry their residual add.
        """
        c = self.config
        w = self.weights
        batch = tokens.shape[0]
        cos, sin = self.rope.cos_sin.index_select(0, positions).unsqueeze(2).unbind(1)  # [B, 1, D] each
        new_rows = (cache.row_index(batch, positions),)  # where each layer's new K/V rows go
        # Query heads that share a KV head become the "query length" axis: GQA without repeating K/V.
        groups = c.num_heads // c.num_kv_heads
        window = (batch, c.num_kv_heads, max_len, c.head_dim)
        if batch > 1:
            # Attention runs as 3-D batched matmuls over [batch * kv_heads] (no 4-D matmul wrapper).
            # Positions beyond a row's own length hold stale or padding K/V: an additive -inf bias,
            # built once per step for all layers, lets the score matmul apply the mask itself.
            flat_batch = batch * c.num_kv_heads
            flat_window, flat_stride = (flat_batch, max_len, c.head_dim), cache.k[0].stride()[1:]
            bias = torch.where(self._arange[:max_len] > positions.view(batch, 1), self._minus_inf, self._zero)
            bias = bias.view(batch, 1, max_len).expand(batch, c.num_heads, max_len)
            bias = bias.reshape(flat_batch, groups, max_len)
        x = w.embed.index_select(0, tokens)
        for index, layer in enumerate(w.layers):
            q, k, v = self._qkv(layer, self._input_norm(layer, x), cos, sin)  # [B, heads, D]
            cache.k_rows[index].index_put_(new_rows, k)
            cache.v_rows[index].index_put_(new_rows, v)
            keys, values = cache.k[index], cache.v[index]
            if batch == 1:  # SDPA's fused kernel wins for one sequence (nothing to mask)
                q = q.view(batch, c.num_kv_heads, groups, c.head_dim)
                # keys[:1, :, :max_len] (likewise values), in one call instead of a parsed index.
                keys, values = keys.as_strided(window, keys.stride()), values.as_strided(window, keys.stride())
                attn = F.scaled_dot_product_attention(q, keys, values, scale=1.0)
            else:  # for many short rows, two batched matmuls beat SDPA's per-row overhead on CPU
                # keys[:batch, :, :max_len] as [batch * kv_heads, max_len, D]: slots and heads are
                # adjacent in the cache, so this is a view.
                keys, values = keys.as_strided(flat_window, flat_stride), values.as_strided(flat_window, flat_stride)
                q = q.reshape(flat_batch, groups, c.head_dim)  # a copy: q is a slice of the q|k rows
                scores = torch.baddbmm(bias, q, keys.transpose(1, 2))
                attn = torch.bmm(torch._softmax(scores, -1, False), values)
            x = layer.o_proj.add_to(x, attn.reshape(batch, -1))
            x = self._mlp(layer, x, routed)
        return self._logits(x)
