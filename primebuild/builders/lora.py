"""LoRA at plan time (no torch): which linear modules a model's decoder layers have, with their shapes,
and how many adapter parameters `trainer.lora` adds (the memory model counts them; primebuild/builders/memory.py).

Module names are those of the HF implementations the fsdp2 trainer builds (transformers' Qwen3 /
Llama-likes: `self_attn.{q,k,v,o}_proj`, `mlp.{gate,up,down}_proj`; MLA: `q_a_proj`, `q_b_proj`,
`kv_a_proj_with_mqa`, `kv_b_proj`). A MoE layer's routed experts are fused 3-D parameters in
transformers 5, not linear modules, so its MLP names are adaptable in dense layers only.
"""

from __future__ import annotations

from primebuild.builders.model_facts import ModelFacts

MLP_MODULES = ("gate_proj", "up_proj", "down_proj")


def attention_modules(f: ModelFacts) -> dict[str, tuple[int, int]]:
    """name -> (in_features, out_features) of every attention projection of one decoder layer."""
    h, nq = f.hidden_size, f.num_attention_heads
    if f.is_mla:
        qk = f.qk_nope_head_dim + f.qk_rope_head_dim
        shapes = {"kv_a_proj_with_mqa": (h, f.kv_lora_rank + f.qk_rope_head_dim),
                  "kv_b_proj": (f.kv_lora_rank, nq * (f.qk_nope_head_dim + f.v_head_dim)),
                  "o_proj": (nq * f.v_head_dim, h)}
        if f.q_lora_rank:
            shapes |= {"q_a_proj": (h, f.q_lora_rank), "q_b_proj": (f.q_lora_rank, nq * qk)}
        else:
            shapes["q_proj"] = (h, nq * qk)
        return shapes
    d = f.head_dim
    return {"q_proj": (h, nq * d), "k_proj": (h, f.num_kv_heads * d), "v_proj": (h, f.num_kv_heads * d),
            "o_proj": (nq * d, h)}


def dense_mlp_modules(f: ModelFacts) -> dict[str, tuple[int, int]]:
    h, i = f.hidden_size, f.intermediate_size
    return {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def adaptable_modules(f: ModelFacts) -> set[str]:
    """Names a `trainer.lora.targets` entry may take for this model."""
    names = set(attention_modules(f))
    if f.num_dense_layers:
        names |= set(MLP_MODULES)
    return names


def adapter_params(f: ModelFacts, rank: int, targets: tuple[str, ...] | list[str]) -> int:
    """Parameters of every adapter: r · (in + out) per adapted module, over the layers that have it."""
    attention, mlp = attention_modules(f), dense_mlp_modules(f)
    total = 0
    for name in targets:
        if name in attention:
            total += f.num_layers * rank * sum(attention[name])
        elif name in mlp and f.num_dense_layers:
            total += f.num_dense_layers * rank * sum(mlp[name])
    return total
