"""Explicit schema versions: migrate what is older, refuse what is newer, never misread silently."""

from __future__ import annotations

import re

from primebuild.errors import Problem, UserError
from primebuild.manifest.schema import API_VERSION
from primebuild.manifest.yaml_source import SourceMap

CURRENT = 1

# v1alpha1 -> v1: renamed fields (old path -> new path).
_V1ALPHA1_RENAMES = {
    ("trainer", "fsdp"): ("trainer", "dp_shard"),
    ("inference", "gpu_memory_util"): ("inference", "gpu_memory_utilization"),
    ("orchestrator", "batch_size"): ("orchestrator", "rollouts_per_step"),
}


# v1 fields that moved to where their one reader's settings live (old path -> new path). A manifest that
# still sets the old path loads, with a note naming the move; setting both is an error.
V1_MOVES = {
    ("orchestrator", "lr"): ("trainer", "optimizer", "lr"),  # only the trainer reads them
    ("orchestrator", "warmup_steps"): ("trainer", "optimizer", "warmup_steps"),
}
# cispo's bound is the same ε as grpo's clip_high (the weight is clipped at 1 + ε), not an absolute cap
# as aipo's is_cap: one name per concept.
_CISPO_RENAMES = {"is_cap": "clip_high"}


def move_fields(doc: dict, source: SourceMap, file: str) -> tuple[dict, list[str]]:
    """The document with moved v1 fields at their new paths, and a note for each move."""
    notes: list[str] = []
    for old, new in V1_MOVES.items():
        parent = _block(doc, old[:-1])
        if parent is None or old[-1] not in parent:
            continue
        target = _block(doc, new[:-1], create=True)
        if new[-1] in target:
            raise UserError(source.problem(old, f"both {'.'.join(old)} and {'.'.join(new)} are set",
                                           hint=f"keep only {'.'.join(new)}"))
        target[new[-1]] = parent.pop(old[-1])
        notes.append(f"{file}: {'.'.join(old)} is now {'.'.join(new)} (moved in memory; update the file to "
                     "silence this)")
    loss = _block(doc, ("orchestrator", "loss"))
    if loss is not None and loss.get("name") == "cispo":
        for old, new in _CISPO_RENAMES.items():
            if old in loss:
                if new in loss:
                    raise UserError(source.problem(("orchestrator", "loss", old), f"both {old!r} and {new!r} are set",
                                                   hint=f"keep only {new!r}"))
                loss[new] = loss.pop(old)
                notes.append(f"{file}: orchestrator.loss.{old} of cispo is now orchestrator.loss.{new} (renamed in "
                             "memory; update the file to silence this)")
    return doc, notes


def _block(doc: dict, path: tuple[str, ...], *, create: bool = False) -> dict | None:
    """The mapping at `path` (created empty along the way with `create`), None where there is none."""
    block = doc
    for key in path:
        child = block.get(key)
        if not isinstance(child, dict):
            if not create or child is not None:
                return None
            child = block[key] = {}
        block = child
    return block


def check_and_migrate(doc: dict, source: SourceMap, file: str) -> tuple[dict, list[str]]:
    """Return the document in the current schema version plus human-readable migration notes."""
    version = doc.get("apiVersion")
    if version is None:
        raise UserError(source.problem((), "missing `apiVersion`", hint=f"add `apiVersion: {API_VERSION}` at the top"))
    match = re.fullmatch(r"primebuild/v(\d+)(alpha\d+|beta\d+)?", str(version))
    if not match:
        raise UserError(source.problem(("apiVersion",), f"unknown apiVersion {version!r}",
                                       hint=f"use `apiVersion: {API_VERSION}`"))
    major, pre = int(match.group(1)), match.group(2)
    if major > CURRENT:
        raise UserError(source.problem(
            ("apiVersion",), f"{version} is newer than this primebuild understands ({API_VERSION})",
            hint="upgrade primebuild (`pip install -U primebuild`) or write the manifest for primebuild/v1"))
    if (major, pre) == (1, None):
        return doc, []
    if (major, pre) == (1, "alpha1"):
        return _from_v1alpha1(doc, file)
    raise UserError(source.problem(("apiVersion",), f"{version} is no longer supported",
                                   hint=f"rewrite the manifest for {API_VERSION} (see `primebuild schema`)"))


def _from_v1alpha1(doc: dict, file: str) -> tuple[dict, list[str]]:
    notes = [f"{file}: migrated apiVersion primebuild/v1alpha1 -> {API_VERSION} in memory; "
             "update the file to silence this"]
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in doc.items()}
    out["apiVersion"] = API_VERSION
    for (section, old), (_, new) in _V1ALPHA1_RENAMES.items():
        block = out.get(section)
        if isinstance(block, dict) and old in block:
            if new in block:
                raise UserError(Problem(f"both {old!r} (v1alpha1) and {new!r} (v1) are set", file=file,
                                        field=f"{section}.{old}", hint=f"keep only {new!r}"))
            block[new] = block.pop(old)
            notes.append(f"  {section}.{old} is now {section}.{new}")
    return out, notes
