"""Publishing a LoRA policy: each step's adapter as a PEFT folder, ``weights/step_{k:06d}/`` (atomic, STABLE
like a full-weight folder), which vLLM loads as a LoRA adapter and the embedded engine merges
(primebuild/runtime/inference/lora.py). The bytes written are logged against the full weights' once, at the first step."""

from __future__ import annotations

import logging

from primebuild.contracts.run_dir import RunDir
from primebuild.contracts.trainer import TrainerConfig
from primebuild.runtime.weight_sync import filesystem as fs

from .lora import ADAPTER_WEIGHTS, adapter_tensors, write_adapter_folder

log = logging.getLogger("primebuild.trainer")


class AdapterPublisher:
    def __init__(self, config: TrainerConfig, env):
        self.config, self.env = config, env
        self.weights_dir = RunDir(config.run_dir).weights
        self.bytes_logged = False

    def publish(self, model, step: int) -> None:
        # either engine's policy names its adapters in PEFT's names (model.py, titan_policy.py)
        tensors = adapter_tensors(model.adapter_parameters())  # a collective under FSDP: every rank gathers
        if not self.env.is_main:
            return
        folder = fs.publish_dir(fs.step_folder(self.weights_dir, step),
                                lambda d: write_adapter_folder(d, tensors, self.config.lora, self.config.model_path),
                                step)
        if not self.bytes_logged:
            import torch

            adapter = (folder / ADAPTER_WEIGHTS).stat().st_size
            full = model.base_numel() * torch.finfo(getattr(torch, self.config.weight_dtype)).bits // 8
            log.info("LoRA: publishing the adapter, %d bytes a step (%d tensors); full %s weights: %d bytes "
                     "(ratio %.4f)", adapter, len(tensors), self.config.weight_dtype, full, adapter / full)
            self.bytes_logged = True
