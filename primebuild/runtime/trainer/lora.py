"""LoRA RL: low-rank adapters on the policy's linear modules, the base frozen (`TrainerConfig.lora`).

peft injects the adapters into the HF model in place (`inject_adapter_in_model`: no PeftModel wrapper,
so `Policy` and the FSDP units stay as they are) while the model is still on the meta device, before
FSDP wraps the blocks; a target module `q_proj` becomes `q_proj.base_layer` (the checkpoint's weight)
plus `q_proj.lora_A.default` / `q_proj.lora_B.default`. Only the adapters require grad, so the
optimizer holds state for them alone, checkpoints hold them alone (checkpoint.py), and each step
publishes them alone as a PEFT folder that inference servers load (vLLM) or merge (embedded engine).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from primebuild.contracts.trainer import LoraConfig
from primebuild.errors import UserError

ADAPTER_NAME = "default"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PEFT's key prefix for an adapter of a causal LM


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def checkpoint_name(name: str) -> str | None:
    """The base checkpoint's name for parameter `name` of an adapted model; None for an adapter's own
    parameters, which the base checkpoint does not have (init_adapters fills them)."""
    return None if is_adapter(name) else name.replace(".base_layer.", ".")


def peft_config(lora: LoraConfig, base_model: str = ""):
    from peft import LoraConfig as PeftLoraConfig

    # dropout 0: the trainer must score exactly the policy the server samples from
    return PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.targets), lora_dropout=0.0,
                          bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base_model)


def apply_lora(hf: nn.Module, lora: LoraConfig) -> None:
    """Inject the adapters (on the meta device, before FSDP) and freeze everything else."""
    from peft import inject_adapter_in_model

    missing = [t for t in lora.targets if not any(n.endswith("." + t) for n, _ in hf.named_modules())]
    if missing:
        raise UserError(f"trainer.lora.targets: {type(hf).__name__} has no module named {', '.join(missing)}")
    inject_adapter_in_model(peft_config(lora), hf, adapter_name=ADAPTER_NAME)
    for name, param in hf.named_parameters():
        param.requires_grad_(is_adapter(name))


def adapter_parameters(hf: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(PEFT name, parameter) of every adapter tensor of a peft-injected model, sorted by name: the order
    init_adapters draws in, the same on both engines (titan_lora.py)."""
    return sorted(((PEFT_PREFIX + name.replace(f".{ADAPTER_NAME}.", "."), param)
                   for name, param in hf.named_parameters() if is_adapter(name)), key=lambda item: item[0])


@torch.no_grad()
def init_adapters(adapters: list[tuple[str, nn.Parameter]], seed: int) -> None:
    """peft's initialisation, the same on every rank and engine: A Kaiming-uniform (a=sqrt(5), as
    nn.Linear), B zero, so the adapted model starts as the base model. `adapters`: (PEFT name, parameter),
    drawn in that order; each rank copies its block of the full tensor."""
    from .sharded_load import _local_block

    generator = torch.Generator().manual_seed(seed)
    for name, param in adapters:
        local, ranges = _local_block(param)
        full = torch.zeros(param.shape)
        if ".lora_A." in name:
            bound = 1 / math.sqrt(param.shape[1])  # kaiming_uniform_(a=sqrt(5)): gain sqrt(1/3) * sqrt(3/fan_in)
            full.uniform_(-bound, bound, generator=generator)
        local.copy_(full[tuple(slice(a, b) for a, b in ranges)])


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def adapter_tensors(adapters: list[tuple[str, nn.Parameter]]) -> dict[str, torch.Tensor]:
    """The full adapter tensors by PEFT name (on every rank: each DTensor is all-gathered)."""
    from .weight_stream import _full

    return {name: _full(param).to("cpu", torch.float32).contiguous() for name, param in adapters}


def write_adapter_folder(folder: Path, tensors: dict[str, torch.Tensor], lora: LoraConfig, base_model: str) -> None:
    """PEFT's layout: adapter_config.json + adapter_model.safetensors (what vLLM and peft load)."""
    from safetensors.torch import save_file

    config = peft_config(lora, base_model).to_dict()
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True, default=str))
    save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
