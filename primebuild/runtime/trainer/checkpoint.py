"""Trainer checkpoints: model + optimizer + step, sharded with torch.distributed.checkpoint (DCP).

Every rank writes its own shards into one staging folder, then rank 0 renames it to
``checkpoints/step_{k:06d}`` and marks it STABLE (weight_sync.filesystem), so a crash mid-save leaves the
previous checkpoint as the newest stable one. DCP re-shards on load, so a run may resume on a different
number of ranks. The learning rate is a function of the step, so the step is all the schedule needs.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from primebuild.runtime.weight_sync import filesystem as fs

from .model import DistEnv

STATE_FILE = "trainer_state.json"


def _options(model: nn.Module) -> StateDictOptions:
    """A frozen base (LoRA) is not checkpointed: it is the run's model_path, read again on resume."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def _model_state(model: nn.Module, model_sd: dict) -> dict:
    """The model's entries to save and load: without its frozen parameters. ignore_frozen_params misses a
    frozen tied weight (the head shares the embedding's parameter and is listed once by named_parameters),
    so every frozen name, shared ones included, is dropped here."""
    frozen = {name.replace("_checkpoint_wrapped_module.", "")
              for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in model_sd.items() if k not in frozen}


def _barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()


def save_checkpoint(
    root: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    env: DistEnv,
    keep_last: int | None = None,
) -> Path:
    final = fs.step_folder(root, step)
    if env.is_main:
        fs.begin(final)
    _barrier(env)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(model))
    with single_process_is_meant():
        dcp.save({"model": _model_state(model, model_sd), "optim": optim_sd},
                 checkpoint_id=str(fs.staging_dir(final)))
    _barrier(env)
    if env.is_main:
        state = {"step": step, "world_size": env.world_size}
        (fs.staging_dir(final) / STATE_FILE).write_text(json.dumps(state))
        fs.commit(final, step)
        if keep_last:
            fs.prune(root, keep_last)
    _barrier(env)
    return final


@contextlib.contextmanager
def single_process_is_meant():
    """DCP without a process group warns that it "assumes" one process, on every save and load (even when
    told so with no_dist=True). A one-rank trainer and an export are that case on purpose: the warning would
    be noise in their logs at every checkpoint."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized",
                                category=UserWarning)
        yield


def load_checkpoint(folder: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Restore model and optimizer in place; returns the step the checkpoint was taken after."""
    folder = Path(folder)
    options = _options(model)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    state = {"model": _model_state(model, model_sd), "optim": optim_sd}
    with single_process_is_meant():
        dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    return int(json.loads((folder / STATE_FILE).read_text())["step"])


def load_model_weights(folder: str | Path, model: nn.Module) -> int:
    """Restore only the model's weights (no optimizer: an export, or a scorer), re-sharded to whatever
    layout `model` has (DCP reads each rank's part of every saved tensor: a checkpoint of 2 FSDP/EP ranks
    loads into one process). Returns the step the checkpoint was taken after."""
    folder = Path(folder)
    options = _options(model)
    state = {"model": _model_state(model, get_model_state_dict(model, options=options))}
    with single_process_is_meant():
        dcp.load(state, checkpoint_id=str(folder))
    set_model_state_dict(model, state["model"], options=options)
    return int(json.loads((folder / STATE_FILE).read_text())["step"])
