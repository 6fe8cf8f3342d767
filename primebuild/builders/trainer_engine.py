"""Which model code the trainer computes with: torchtitan's modules or transformers' eager layers.

`trainer.engine: auto` (the default) takes torchtitan wherever this project has built it for the model
and the layout, and says why when it does not; `torchtitan` asks for it and is refused, naming every
gap, where it cannot apply; `hf` keeps transformers' layers. Pure: no torch, no torchtitan import.
"""

from __future__ import annotations

# model_type -> what the torchtitan engine builds for it (runtime/trainer/titan_model.py)
TITAN_MODELS = {"qwen3": "torchtitan's Qwen3", "qwen3_moe": "torchtitan's Qwen3 MoE (grouped experts)"}


def titan_gaps(cp: int, tp: int, model_type: str | None) -> list[str]:
    """What the torchtitan engine does not do yet for this model and layout (empty: it does it all).
    `model_type` None: not known here (a hand-written trainer config; the trainer's model load checks).
    FP8 training and LoRA run on both engines (runtime/trainer/titan_fp8.py, titan_lora.py)."""
    gaps = []
    if model_type is not None and model_type not in TITAN_MODELS:
        gaps.append(f"model_type {model_type or '?'!r} is not built for it (it builds {', '.join(TITAN_MODELS)})")
    if cp > 1:
        gaps.append("context parallelism runs as a transformers attention function (runtime/trainer/context_parallel.py)")
    if tp > 1:
        gaps.append("tensor parallelism is not built on either engine")
    return gaps


def manifest_gaps(m, model_type: str) -> list[str]:
    t = m.trainer
    return titan_gaps(t.cp, t.tp, model_type)


def trainer_engine(m, model_type: str) -> tuple[str, str]:
    """(engine, why) for the manifest `m` training a model of `model_type`. An explicit `torchtitan` that
    cannot apply is refused by capabilities.py with the same gaps; here it resolves to what would run."""
    if m.trainer.engine == "hf":
        return "hf", "trainer.engine: hf"
    gaps = manifest_gaps(m, model_type)
    if not gaps:
        return "torchtitan", TITAN_MODELS[model_type]
    return "hf", "transformers' eager layers, not torchtitan: " + "; ".join(gaps)
