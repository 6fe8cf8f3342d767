"""The architecture facts the embedded engine's forward pass needs, read from an HF `config.json`, and the
model types it implements (qwen3, qwen3_moe with default RoPE and full attention)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from primebuild.contracts.inference import EMBEDDED_MODEL_TYPES
from primebuild.errors import Problem, UserError
from primebuild.json_file import read_json

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
