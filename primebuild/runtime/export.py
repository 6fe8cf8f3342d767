"""Write a run's checkpoint as a Hugging Face folder: the policy the trainer trained, loadable by
transformers, vLLM, the embedded engine, or a manifest's `model:` (primebuild/builders/export.py keys it).

The checkpoint is read through the trainer's own policy, built for one process on the CPU with the
run's engine (transformers' or torchtitan's modules) and filled from the DCP checkpoint, which
re-shards on load: a checkpoint of any number of FSDP / EP ranks, taken in any weight-sync mode, reads
the same way. The weights are then written by the very code that publishes `weights/step_k` in
filesystem mode (`published_weights`: the checkpoint's own names, torchtitan's through its state-dict
adapter, MoE experts unfused, a tied head under both names), a group at a time, cut into shards above
a size. So an exported folder is what a filesystem-mode run would have published at that step, also for
a broadcast-mode run, which publishes nothing to disk.

LoRA: the checkpoint holds only the adapters (the base is the run's model); by default they are merged
into the base weights (W + B A * alpha / r, peft's merge) and the folder is a plain model; with
`adapter` it is the PEFT adapter folder the run's servers loaded.

Memory: one process holds the whole model in fp32 (plus one group being written). That is the tiny and
mid-size case; a model larger than one host's memory needs the export run under torchrun with the
run's layout, which this module does not do yet.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from primebuild.builders.export import DEFAULT_MAX_SHARD_BYTES, ExportSource, export_derivation
from primebuild.builders.store import Store
from primebuild.contracts.run_dir import RunDir
from primebuild.contracts.trainer import TrainerConfig
from primebuild.kernels.dtypes import DTYPES
from primebuild.runtime.trainer.checkpoint import load_model_weights
from primebuild.runtime.trainer.model import DistEnv, load_model
from primebuild.runtime.weight_sync import filesystem as fs

log = logging.getLogger("primebuild.export")

ONE_CPU_PROCESS = DistEnv(rank=0, world_size=1, device=torch.device("cpu"))


def load_policy(trainer: TrainerConfig, checkpoint: str | Path) -> nn.Module:
    """The run's policy (its engine, its LoRA adapters) with the checkpoint's weights, in fp32, on the CPU
    of this one process. `checkpoint` must already be verified (weight_sync.filesystem.verify)."""
    chunk = trainer.logprob_chunk_tokens
    if trainer.engine == "torchtitan":
        from primebuild.runtime.trainer.titan_policy import load_titan_model

        policy = load_titan_model(trainer.model_path, ONE_CPU_PROCESS, "float32", False, chunk, lora=trainer.lora,
                                  seed=trainer.seed)
    else:
        policy = load_model(trainer.model_path, ONE_CPU_PROCESS, "float32", False, chunk, lora=trainer.lora,
                            seed=trainer.seed)
    load_model_weights(checkpoint, policy)
    return policy.eval()


def merge_adapters(policy: nn.Module) -> int:
    """Fold every LoRA adapter into its base layer and put the base layer back in its place, so the
    module names (and the published names) are the base model's. Returns how many were merged."""
    if hasattr(policy, "titan"):  # the torchtitan engine's LoraLinear (titan_lora.py)
        from primebuild.runtime.trainer.titan_lora import merge_adapters as merge_titan_adapters

        return merge_titan_adapters(policy.titan)
    from peft.tuners.lora import LoraLayer

    merged = 0
    for name, module in list(policy.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent, _, child = name.rpartition(".")
            setattr(policy.get_submodule(parent), child, module.get_base_layer())
            merged += 1
    return merged


def write_export(trainer: TrainerConfig, checkpoint: str | Path, out: Path, *, adapter: bool,
                 max_shard_bytes: int) -> dict:
    """Fill the empty folder `out` with the checkpoint's model (or adapter), from a verified checkpoint;
    returns what was written."""
    policy = load_policy(trainer, checkpoint)
    if adapter:
        from primebuild.runtime.trainer.lora import adapter_tensors, write_adapter_folder

        tensors = adapter_tensors(policy.adapter_parameters())
        write_adapter_folder(out, tensors, trainer.lora, trainer.model_path)
        return {"form": "adapter", "tensors": len(tensors)}
    merged = merge_adapters(policy) if trainer.lora is not None else 0
    weights = policy.published_weights(DTYPES[trainer.weight_dtype])
    fs.write_hf_folder(out, weights, policy.config, trainer.model_path, max_shard_bytes=max_shard_bytes)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    log.info("exported %d tensors into %d file(s)%s", len(weights.layout), len(files),
             f", {merged} LoRA adapters merged" if merged else "")
    return {"form": "merged" if merged else "full", "tensors": len(weights.layout), "files": files}


def newest_verified_step(run_dir: str | Path, warn=log.warning) -> int | None:
    """The newest checkpoint step of the run that verifies (newer damaged ones are named to `warn`);
    None when there is none (export_source then says what there is)."""
    latest = fs.latest_verified(RunDir(run_dir).checkpoints, warn=warn)
    return latest[0] if latest is not None else None


def export_into_store(source: ExportSource, store: Store, *, adapter: bool = False,
                      max_shard_bytes: int | None = None) -> tuple[Path, bool]:
    """The store entry of `source`: (its path, whether it existed). The checkpoint is verified before
    anything is written; an existing entry is verified too (the store refuses one whose content is not
    what it was built with), so bad input changes nothing."""
    shard = max_shard_bytes or DEFAULT_MAX_SHARD_BYTES
    derivation = export_derivation(source, store.root, adapter=adapter, max_shard_bytes=shard)
    fs.verify(source.checkpoint)
    if store.lookup(derivation.key) is not None:
        return store.path_of(derivation.key), True
    path = store.build(derivation.name, derivation.inputs,
                       lambda out: write_export(source.trainer, source.checkpoint, out, adapter=adapter,
                                                max_shard_bytes=shard))
    return path, False
