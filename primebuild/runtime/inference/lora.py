"""LoRA in the embedded engine: a published adapter folder (PEFT layout: adapter_config.json +
adapter_model.safetensors, primebuild/runtime/trainer/lora.py) is merged into the served model's base weights,
W = W0 + (alpha / r) · B·A in fp32, and the merged state dict is swapped in like any weight update.

Merging on update keeps the forward pass as it is (no adapter matmuls per token); the base tensors are
read once and kept, so every update merges into the same W0, never into an earlier merge."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from primebuild.errors import Problem, UserError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."

if TYPE_CHECKING:  # the orchestrator asks is_adapter_folder without importing torch
    import torch


def is_adapter_folder(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def _base_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


class AdapterMerger:
    def __init__(self, base_folder: str | Path):
        self.base = _base_tensors(Path(base_folder))

    def merged(self, adapter_folder: str | Path) -> dict[str, torch.Tensor]:
        """The base state dict with every adapted module's weight replaced by W0 + scale · B·A."""
        import torch
        from safetensors.torch import load_file

        folder = Path(adapter_folder)
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
        if config.get("use_dora") or config.get("use_rslora"):
            raise UserError(Problem("DoRA / rsLoRA adapters are not merged by the embedded engine",
                                    file=str(folder / ADAPTER_CONFIG)))
        scale = float(config["lora_alpha"]) / int(config["r"])
        adapter = load_file(str(folder / ADAPTER_WEIGHTS))
        out = dict(self.base)
        for key, a in adapter.items():
            if not key.endswith(".lora_A.weight"):
                continue
            module = key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
            b = adapter.get(f"{PEFT_PREFIX}{module}.lora_B.weight")
            base = self.base.get(f"{module}.weight")
            if b is None or base is None:
                raise UserError(Problem(f"adapter tensor {key!r} has no lora_B or no base weight {module}.weight",
                                        file=str(folder / ADAPTER_WEIGHTS)))
            delta = scale * (b.to(torch.float32) @ a.to(torch.float32))
            if delta.shape != base.shape:
                raise UserError(Problem(f"adapter of {module}: B·A is {tuple(delta.shape)}, the base weight "
                                        f"{tuple(base.shape)}", file=str(folder / ADAPTER_WEIGHTS)))
            out[f"{module}.weight"] = (base.to(torch.float32) + delta).to(base.dtype)
        return out
