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
