"""Architecture facts of a decoder-only LLM, read from its HF `config.json`.

The planner needs only a handful of numbers to size memory and time: widths, depths, the MoE and MLA
shapes. `facts_from_hf_config` reads them from the key spellings of Qwen3, Qwen3-MoE, DeepSeek-V3 and
GLM-MoE-DSA (GLM-5) configs; everything else derives from `ModelFacts` by the formulas below.

Parameter counts assume what these families share: gated (SwiGLU) MLPs with three matrices, RMSNorm
(one weight vector), no biases unless the config asks for q/k/v biases. Multi-token-prediction layers
(`num_nextn_predict_layers`) are not counted: published totals (744B for GLM-5) exclude them and
training/inference here does not load them.

Pure Python on purpose: `primebuild plan` imports this and must never pull in torch.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from primebuild.errors import Problem, UserError
from primebuild.json_file import read_json

# Committed architecture facts of known models (HF config.json form).
KNOWN_MODELS_DIR = Path(__file__).resolve().parents[2] / "manifests" / "models"


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts by role (whole model, unsharded)."""

    embedding: int
    lm_head: int  # 0 when tied to the embedding
    attention: int  # projections, q/k norms, MLA latent norms, DSA indexer
    dense_mlp: int  # MLPs of the dense layers
    shared_experts: int
    routed_experts: int
    router: int
    norms: int  # per-layer RMSNorms and the final norm

    @property
    def total(self) -> int:
        return (
            self.embedding + self.lm_head + self.attention + self.dense_mlp
            + self.shared_experts + self.routed_experts + self.router + self.norms
        )

    @property
    def matmul_weights(self) -> int:
        """Weights of the linear layers that FP8 checkpoints quantise (not embeddings, router, norms)."""
        return self.attention + self.dense_mlp + self.shared_experts + self.routed_experts


@dataclass(frozen=True)
class ModelFacts:
    architecture: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int  # per-head q/k width; for MLA qk_nope_head_dim + qk_rope_head_dim
    vocab_size: int
    intermediate_size: int  # dense-layer MLP width
    num_dense_layers: int  # layers whose MLP is dense (== num_layers for a dense model)
    # MoE (num_experts == 0: dense model)
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0  # each as wide as a routed expert
    # MLA (all 0 when attention is plain MHA/GQA)
    q_lora_rank: int = 0  # 0 with MLA: queries projected directly from the hidden state
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # DeepSeek sparse attention (DSA) indexer (all 0 without one)
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0  # keys each query attends to; 0 = dense attention
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 0  # 0 = unknown
    qk_norm: bool = False  # Qwen3: RMSNorm on each q and k head
    qkv_bias: bool = False
    model_type: str = ""  # the HF config's model_type (which runtime code paths apply)
    moe_layers: tuple[int, ...] = ()  # indices of the decoder layers with routed experts
    quantized: str = ""  # quantization_config.quant_method of a pre-quantised checkpoint ("fp8"), else ""

    # ---- shape ----------------------------------------------------------------------------------

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def expert_size(self) -> int:
        """Parameters of one routed (or shared) expert: gate, up and down matrices."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def attention_params_per_layer(self) -> int:
        h, nq = self.hidden_size, self.num_attention_heads
        if self.is_mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.q_lora_rank:
                q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * nq * qk
            else:
                q = h * nq * qk
            kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
            kv_b = self.kv_lora_rank * nq * (self.qk_nope_head_dim + self.v_head_dim)
            out = nq * self.v_head_dim * h
            params = q + kv_a + kv_b + out
        else:
            q_width, kv_width = nq * self.head_dim, self.num_kv_heads * self.head_dim
            params = h * q_width + 2 * h * kv_width + q_width * h
            if self.qkv_bias:
                params += q_width + 2 * kv_width
            if self.qk_norm:
                params += 2 * self.head_dim
        if self.index_n_heads:
            q_in = self.q_lora_rank or h
            params += (
                q_in * self.index_n_heads * self.index_head_dim  # wq_b
                + h * self.index_head_dim  # wk
                + 2 * self.index_head_dim  # k_norm (LayerNorm: weight and bias)
                + h * self.index_n_heads  # per-head weights
            )
        return params

    def param_counts(self) -> ParamCounts:
        h, moe_layers = self.hidden_size, self.num_moe_layers
        embedding = self.vocab_size * h
        return ParamCounts(
            embedding=embedding,
            lm_head=0 if self.tie_word_embeddings else embedding,
            attention=self.num_layers * self.attention_params_per_layer(),
            dense_mlp=self.num_dense_layers * 3 * h * self.intermediate_size,
            shared_experts=moe_layers * self.num_shared_experts * self.expert_size,
            routed_experts=moe_layers * self.num_experts * self.expert_size,
            router=moe_layers * self.num_experts * h,
            norms=self.num_layers * 2 * h + h,
        )

    # ---- counts the planner uses -----------------------------------------------------------------

    def total_params(self) -> int:
        return self.param_counts().total

    def expert_params(self) -> int:
        """Routed-expert parameters: the part expert parallelism shards."""
        return self.param_counts().routed_experts

    def dense_params(self) -> int:
        """Everything that is not a routed expert (replicated or FSDP-sharded like a dense model)."""
        return self.total_params() - self.expert_params()

    def active_params(self) -> int:
        """Parameters one token touches: all but the routed experts it is not sent to.

        Counts the embedding table like the Qwen3 and GLM-5 model cards do (3.3B, 40B).
        """
        active_experts = self.num_moe_layers * self.experts_per_token * self.expert_size
        return self.total_params() - self.expert_params() + active_experts

    def matmul_params_per_token(self) -> int:
        """Active parameters that take part in a matmul per token (the N of 2·N flops, and what decode
        reads per token): the embedding lookup reads one row, the lm_head always multiplies."""
        counts = self.param_counts()
        return self.active_params() - counts.embedding - counts.lm_head + self.vocab_size * self.hidden_size

    def kv_elements_per_token_per_layer(self, *, tp: int = 1) -> tuple[int, int]:
        """(attention cache elements, DSA indexer-key elements) one token adds to one layer on one
        tensor-parallel rank.

        MLA caches the compressed latent (kv_lora_rank) plus the shared rope key (qk_rope_head_dim);
        every TP rank needs the whole latent, so it is replicated, not split, across TP.
        GQA caches K and V for each KV head; TP splits the heads (replicating them when tp > heads).
        """
        if self.is_mla:
            attention = self.kv_lora_rank + self.qk_rope_head_dim
        else:
            heads_per_rank = math.ceil(self.num_kv_heads / tp)
            attention = 2 * heads_per_rank * self.head_dim
        return attention, self.index_head_dim

    def kv_bytes_per_token(self, dtype_bytes: float, *, tp: int = 1) -> int:
        """KV-cache bytes one token occupies across all layers (on one TP rank)."""
        attention, indexer = self.kv_elements_per_token_per_layer(tp=tp)
        return math.ceil(self.num_layers * (attention + indexer) * dtype_bytes)


# ---- reading HF configs ------------------------------------------------------------------------


_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def _problem(source: str, key: str, message: str, hint: str | None = None) -> UserError:
    return UserError(Problem(message, file=source, field=key, hint=hint))


def _int(cfg: dict[str, Any], key: str, source: str, default: int | None = None) -> int:
    value = cfg.get(key)
    if value is None:
        if default is not None:
            return default
        raise _problem(
            source, key, f"missing key '{key}' needed to size the model",
            hint=f"add \"{key}\" to the model's config.json (copy it from the model's published config)",
        )
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _problem(source, key, f"'{key}' must be a non-negative integer, got {value!r}")
    return value


def moe_layer_indices(cfg: dict[str, Any], num_layers: int, source: str) -> tuple[int, ...]:
    """The decoder layers with routed experts, from whichever layout key the family uses."""
    layer_types = cfg.get("mlp_layer_types")
    if isinstance(layer_types, list):  # transformers 5 GLM-MoE-DSA: ["dense", ..., "sparse", ...]
        if len(layer_types) != num_layers:
            raise _problem(
                source, "mlp_layer_types",
                f"has {len(layer_types)} entries but num_hidden_layers is {num_layers}",
            )
        return tuple(i for i, kind in enumerate(layer_types) if kind == "sparse")
    if "first_k_dense_replace" in cfg:  # DeepSeek-V3 / GLM: the first k layers are dense
        first_dense = _int(cfg, "first_k_dense_replace", source)
        freq = _int(cfg, "moe_layer_freq", source, default=1) or 1
        return tuple(i for i in range(first_dense, num_layers) if i % freq == 0)
    # Qwen-MoE: layer i is sparse when (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers
    step = _int(cfg, "decoder_sparse_step", source, default=1) or 1
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    return tuple(i for i in range(num_layers) if i not in mlp_only and (i + 1) % step == 0)


def facts_from_hf_config(cfg: dict[str, Any], source: str) -> ModelFacts:
    """Read `ModelFacts` from a HF config.json dict; `source` names the file in error messages."""
    if not isinstance(cfg, dict):
        raise UserError(Problem("a model config must be a JSON object", file=source))
    if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]  # multimodal wrappers keep the language model here
    model_type = str(cfg.get("model_type") or "")
    architectures = cfg.get("architectures") or []
    architecture = str(architectures[0]) if architectures else model_type or "unknown"
    # both are quoted in messages, plans and the comment lines of rendered scripts: names, nothing more
    for key, name in (("model_type", model_type), ("architectures", architecture)):
        if name and not _NAME.fullmatch(name):
            raise _problem(source, key, f"{key} {name!r} is not a model class name",
                           hint="letters, digits, '_', '.' and '-' only, as in the model's published config.json")

    hidden = _int(cfg, "hidden_size", source)
    num_layers = _int(cfg, "num_hidden_layers", source)
    heads = _int(cfg, "num_attention_heads", source)
    vocab = _int(cfg, "vocab_size", source)
    if not (hidden and num_layers and heads and vocab):
        raise _problem(source, "hidden_size", "hidden_size, num_hidden_layers, num_attention_heads and "
                       "vocab_size must all be positive")
    kv_heads = _int(cfg, "num_key_value_heads", source, default=heads)

    mla: dict[str, int] = {}
    if cfg.get("kv_lora_rank"):
        mla = {
            "q_lora_rank": _int(cfg, "q_lora_rank", source, default=0),
            "kv_lora_rank": _int(cfg, "kv_lora_rank", source),
            "qk_rope_head_dim": _int(cfg, "qk_rope_head_dim", source),
            "qk_nope_head_dim": _int(cfg, "qk_nope_head_dim", source),
            "v_head_dim": _int(cfg, "v_head_dim", source),
        }
        head_dim = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
    else:
        if cfg.get("head_dim") is None and hidden % heads:
            raise _problem(source, "head_dim", f"missing key 'head_dim' and hidden_size {hidden} is not "
                           f"divisible by num_attention_heads {heads}")
        head_dim = _int(cfg, "head_dim", source, default=hidden // heads)

    num_experts = 0
    for key in ("n_routed_experts", "num_experts", "num_local_experts"):
        if cfg.get(key) is not None:
            num_experts = _int(cfg, key, source)
            break
    moe: dict[str, int] = {}
    if num_experts:
        if cfg.get("moe_intermediate_size") is None and model_type == "mixtral":
            moe_width = _int(cfg, "intermediate_size", source)  # Mixtral's experts use intermediate_size
        else:
            moe_width = _int(cfg, "moe_intermediate_size", source)
        shared = _int(cfg, "n_shared_experts", source, default=0)
        shared_width = cfg.get("shared_expert_intermediate_size")
        if not shared and shared_width:  # Qwen2-MoE spells a shared expert by its width
            if shared_width % moe_width:
                raise _problem(source, "shared_expert_intermediate_size", "must be a multiple of "
                               f"moe_intermediate_size ({moe_width}) for primebuild's sizing")
            shared = shared_width // moe_width
        moe = {
            "num_experts": num_experts,
            "experts_per_token": _int(cfg, "num_experts_per_tok", source),
            "moe_intermediate_size": moe_width,
            "num_shared_experts": shared,
        }
        moe_layers = moe_layer_indices(cfg, num_layers, source)
    else:
        moe_layers = ()
    num_dense = num_layers - len(moe_layers)
    intermediate = _int(cfg, "intermediate_size", source, default=None if num_dense else 0)

    index: dict[str, int] = {}
    if cfg.get("index_n_heads"):
        index = {
            "index_n_heads": _int(cfg, "index_n_heads", source),
            "index_head_dim": _int(cfg, "index_head_dim", source),
            "index_topk": _int(cfg, "index_topk", source),
        }

    return ModelFacts(
        architecture=architecture,
        hidden_size=hidden,
        num_layers=num_layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        intermediate_size=intermediate,
        num_dense_layers=num_dense,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=_int(cfg, "max_position_embeddings", source, default=0),
        qk_norm=model_type in ("qwen3", "qwen3_moe") or bool(cfg.get("use_qk_norm")),
        qkv_bias=model_type in ("qwen2", "qwen2_moe") or bool(cfg.get("attention_bias")),
        model_type=model_type,
        moe_layers=moe_layers,
        quantized=str((cfg.get("quantization_config") or {}).get("quant_method") or ""),
        **mla,
        **moe,
        **index,
    )


def load_model_facts(path: str | Path) -> ModelFacts:
    """Read a config.json file into `ModelFacts`."""
    return facts_from_hf_config(read_json(path, what="model config file"), str(path))


def known_model_facts(name: str) -> ModelFacts:
    """Facts of a model committed under manifests/models/ (e.g. "glm-5")."""
    path = KNOWN_MODELS_DIR / f"{name}.json"
    if not path.is_file():
        known = sorted(p.stem for p in KNOWN_MODELS_DIR.glob("*.json"))
        raise UserError(f"unknown model '{name}'", hint=f"known models: {', '.join(known)}; or point to a "
                        "config.json")
    return load_model_facts(path)
