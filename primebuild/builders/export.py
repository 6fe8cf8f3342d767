"""A run's trained policy as a derivation, computed purely: which checkpoint, and its store key.

`primebuild export RUN_DIR [--step N]` and a manifest's `model: {from_run: RUN_DIR, step: N}` both call
`export_derivation`, so the command and `lock`/`plan` agree on the store entry without either one
recomputing a key. The key covers what the exported folder is made of: the checkpoint's bytes (the
file listing of its STABLE marker, sha256 per file), the base model it was trained from (LoRA keeps only
the adapters in a checkpoint; config and tokenizer come from the base), the trainer engine whose
parameter names the checkpoint uses, the dtype the run publishes in, and the export's own options.

Pure: reads the run's plan, rendezvous and markers as JSON; never torch. Which checkpoint is *verified*
(every file re-hashed against its marker) is the runtime's check (primebuild/runtime/export.py), made
before anything is written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from primebuild.builders.derivations import Derivation
from primebuild.contracts.plan import read_plan
from primebuild.contracts.run_dir import STEP_NAME, RunDir, step_folder
from primebuild.contracts.trainer import TrainerConfig
from primebuild.errors import UserError
from primebuild.hashing import sha256_json

# Bump when what the exporter writes changes: the store key must change with it.
EXPORT_BUILDER = "export/1"
STABLE = "STABLE"  # the marker weight_sync/filesystem.py writes last into a step folder (not imported: torch)
# Hugging Face's own default shard size for save_pretrained: one file up to 5 GB, several above.
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


@dataclass(frozen=True)
class ExportSource:
    """A run's checkpoint and what the exporter needs to read it."""

    run: RunDir
    step: int
    checkpoint: Path
    trainer: TrainerConfig  # the run's trainer config, `model_path` resolved to the run's base model
    name: str  # the run's manifest name


def trainer_config(run: RunDir) -> tuple[TrainerConfig, str]:
    """The run's trainer config (as the plan typed it, its base model resolved) and the run's name."""
    run.require(resumable=True)
    run.require_models()
    plan = read_plan(run.plan)
    trainers = [p.config for p in plan.by_role("trainer") if isinstance(p.config, TrainerConfig)]
    if not trainers:
        raise UserError(f"{run.plan}: the plan has no trainer process, so its run has no checkpoint to export",
                        hint="export a run of an RL manifest (an `sft:` manifest's output is already a store entry)")
    model_path = run.read_rendezvous().model_path
    config = trainers[0].model_copy(update={"model_path": model_path, "run_dir": str(run.root)})
    return config, plan.name


def checkpoint_steps(run: RunDir) -> list[int]:
    """Steps of the run's complete checkpoint folders (those with a STABLE marker), oldest first."""
    root = run.checkpoints
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir()
                  if (m := STEP_NAME.match(p.name)) and (p / STABLE).is_file())


def export_source(run_dir: str | Path, step: int | None, *, where: str = "RUN_DIR") -> ExportSource:
    """The checkpoint of `step` (None: the newest complete one) of the run at `run_dir`; a located
    UserError for a folder that is not a run or a step that has no complete checkpoint."""
    run = RunDir(Path(run_dir).expanduser().absolute())
    if not run.root.is_dir():
        raise UserError(f"{where} {run.root}: no such folder", hint="give the folder `primebuild run` printed")
    config, name = trainer_config(run)
    steps = checkpoint_steps(run)
    have = f"complete checkpoints: {', '.join(map(str, steps))}" if steps else "the run has no complete checkpoint"
    if step is None:
        if not steps:
            raise UserError(f"{run.checkpoints}: no complete checkpoint to export ({have})",
                            hint="a run checkpoints every trainer.checkpoint_every steps and at its end")
        step = steps[-1]
    elif step not in steps:
        raise UserError(f"{step_folder(run.checkpoints, step)}: no complete checkpoint of step {step} ({have})",
                        hint="give --step one of those, or none for the newest")
    return ExportSource(run, step, step_folder(run.checkpoints, step), config, name)


def checkpoint_hash(folder: Path) -> str:
    """sha256 of the checkpoint's file listing (each file's size and sha256, from its STABLE marker)."""
    try:
        files = json.loads((folder / STABLE).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"{folder / STABLE}: not a checkpoint marker ({err})",
                        hint="the checkpoint is damaged; export another step") from None
    return sha256_json(files)


def store_ref(path: str, store_root: Path) -> str:
    """A machine-independent name for the base model: its store entry, else the folder itself."""
    try:
        return Path(path).resolve().relative_to(store_root.resolve()).parts[0]
    except (ValueError, IndexError):
        return str(path)


def export_derivation(source: ExportSource, store_root: Path, *, adapter: bool = False,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Derivation:
    """The store entry holding `source`'s policy: merged HF weights, or (`adapter`) the LoRA adapter."""
    trainer = source.trainer
    if adapter and trainer.lora is None:
        raise UserError(f"--adapter: run {source.run.root} trained the full model, not a LoRA adapter",
                        hint="export it without --adapter")
    inputs = {
        "builder": EXPORT_BUILDER,
        "checkpoint": checkpoint_hash(source.checkpoint),
        "step": source.step,
        "base": store_ref(trainer.model_path, store_root),
        "engine": trainer.engine,
        "lora": trainer.lora.model_dump(mode="json") if trainer.lora is not None else None,
        "dtype": trainer.weight_dtype,
        "form": "adapter" if adapter else "merged" if trainer.lora is not None else "full",
        "max_shard_bytes": max_shard_bytes,
    }
    return Derivation(f"{source.name}-step{source.step}{'-adapter' if adapter else ''}", inputs)
