"""Which model code the trainer computes with: torchtitan's modules or transformers' eager layers.

`trainer.engine: auto` (the default) takes torchtitan wherever this project has built it for the model
and the layout, and says why when it does not; `torchtitan` asks for it and is refused, naming every
gap, where it cannot apply; `hf` keeps transformers' layers. Pure: no torch, no torchtitan import.
"""

from __future__ import annotations

# model_type -> what the torchtitan engine builds for it (runtime/trainer/titan_model.py)
TITAN_MODELS = {"qwen3": "torchtitan's Qwen3", "qwen3_moe": "torchtitan's Qwen3 MoE (grouped experts)"}


# model_type -> why torchtitan cannot train it here (checked: ../shared/notes/torchtitan.md); its expert and
# context parallelism stay this project's own on transformers' layers (runtime/trainer/expert_parallel.py,
# context_parallel.py)
NOT_IN_TORCHTITAN = {
    "glm_moe_dsa": "torchtitan 0.3.0 has no GLM model, and its transformers backend, which would wrap GLM-5's "
                   "modeling code, runs only with its spmd_types backend, which torch 2.13's FSDP refuses; "
                   "EP and CP run on this project's own code for transformers' layers",
}


def titan_gaps(model_type: str | None) -> list[str]:
    """What the torchtitan engine does not do yet for this model, whatever the layout (empty: it does it all).
    `model_type` None: not known here (the trainer's model load checks).
    FP8 training, LoRA, context and tensor parallelism (a MoE's too, beside EP or not) run on it
    (runtime/trainer/titan_fp8.py, titan_lora.py, titan_model.py, titan_parallelize.py)."""
    gaps = []
    if model_type in NOT_IN_TORCHTITAN:
        gaps.append(f"model_type {model_type!r}: {NOT_IN_TORCHTITAN[model_type]}")
    elif model_type is not None and model_type not in TITAN_MODELS:
        gaps.append(f"model_type {model_type or '?'!r} is not built for it (it builds {', '.join(TITAN_MODELS)})")
    return gaps


def trainer_engine(m, model_type: str) -> tuple[str, str]:
    """(engine, why) for the manifest `m` training a model of `model_type`. An explicit `torchtitan` that
    cannot apply is refused by capabilities.py with the same gaps; here it resolves to what would run."""
    if m.trainer.engine == "hf":
        return "hf", "trainer.engine: hf"
    gaps = titan_gaps(model_type)
    if not gaps:
        return "torchtitan", TITAN_MODELS[model_type]
    return "hf", "transformers' eager layers, not torchtitan: " + "; ".join(gaps)
