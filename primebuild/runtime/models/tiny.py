"""The embedded default's model: a Qwen3 small enough to train on a laptop CPU in seconds.

Defaults are the calibrated ones (shared/notes/calibration.md): hidden 128, 2 layers, 4 heads of
32, intermediate 512, tied embeddings over the 32-id char vocabulary: 0.53M parameters. It is a
stock `Qwen3ForCausalLM`, so the trainer, the inference engines and `from_pretrained` treat it like
any real checkpoint.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from primebuild.errors import UserError
from primebuild.runtime.models.char_tokenizer import BOS, EOS, PAD, VOCAB, build_char_tokenizer

MAX_POSITIONS = 128  # reverse-text sequences are <= 28 tokens; headroom for other toy tasks


def tiny_config(
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 4,
    intermediate_size: int = 512,
    max_positions: int = MAX_POSITIONS,
):
    """The Qwen3 config of the tiny model (transformers imported lazily: it is heavy)."""
    from transformers import Qwen3Config

    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise UserError(
            f"tiny model: hidden_size {hidden_size} must divide by num_heads {num_heads}, "
            f"and num_heads by num_kv_heads {num_kv_heads}"
        )
    return Qwen3Config(
        vocab_size=len(VOCAB),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,  # Qwen3's default head_dim (128) would be wrong here
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,  # the vocabulary is tiny; tying just saves the duplicate
        bos_token_id=VOCAB.index(BOS),
        eos_token_id=VOCAB.index(EOS),
        pad_token_id=VOCAB.index(PAD),
        dtype="float32",
    )


# Mixture-of-experts facts a tiny Qwen3-MoE takes from its facts file (manifests/models/*.json).
MOE_FACTS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
             "mlp_only_layers", "router_aux_loss_coef")


def tiny_config_from_facts(arch: dict):
    """The config of a tiny model described by architecture facts (HF config.json form): the dense
    Qwen3 of `tiny_config`, or, for `model_type: qwen3_moe`, the same attention with a Qwen3-MoE block."""
    dense = tiny_config(hidden_size=arch["hidden_size"], num_layers=arch["num_hidden_layers"],
                        num_heads=arch["num_attention_heads"], num_kv_heads=arch["num_key_value_heads"],
                        intermediate_size=arch["intermediate_size"],
                        max_positions=arch.get("max_position_embeddings", MAX_POSITIONS))
    if arch.get("model_type", "qwen3") == "qwen3":
        return dense
    if arch["model_type"] != "qwen3_moe":
        raise UserError(f"tiny models are qwen3 or qwen3_moe, not {arch['model_type']!r}",
                        hint="set model_type in the facts file to qwen3 or qwen3_moe")
    from transformers import Qwen3MoeConfig

    shared = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
              "eos_token_id", "pad_token_id")
    return Qwen3MoeConfig(**{k: getattr(dense, k) for k in shared}, **{k: arch[k] for k in MOE_FACTS if k in arch},
                          dtype="float32")


def init_tiny_model(config, seed: int):
    """A randomly initialised `Qwen3ForCausalLM`, identical for the same config and seed.

    The caller's global RNG state is left as it was, so building a model never perturbs the
    sampling or data order of whoever asked for it.
    """
    import torch
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model.float().eval()


def save_hf_folder(model, tokenizer, out_dir: str | Path) -> Path:
    """Write config + safetensors + tokenizer into `out_dir`, all at once or not at all.

    Files go to a temporary sibling first, then one rename publishes the folder, so a reader never
    sees a half-written checkpoint (DESIGN.md: weights on disk). Outputs are immutable: an existing
    `out_dir` is refused rather than overwritten.
    """
    out = Path(out_dir)
    if out.exists():
        raise UserError(
            f"{out}: output folder already exists", hint="choose a new folder or delete the old one"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        os.chmod(staging, 0o755)  # mkdtemp makes it owner-only; a published model is for every reader
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging, save_jinja_files=False)
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def build_tiny_model(
    out_dir: str | Path,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 4,
    intermediate_size: int = 512,
    seed: int = 0,
) -> Path:
    """Write a randomly initialised tiny model as an HF folder; same arguments -> same bytes."""
    config = tiny_config(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
    )
    return save_hf_folder(init_tiny_model(config, seed), build_char_tokenizer(), out_dir)
