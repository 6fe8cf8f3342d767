"""Step folders made visible atomically and verifiable, and the readers' side of that contract.

A step folder is written under a hidden staging name in the same parent directory, renamed into place
(one atomic ``rename`` on POSIX), and then marked with a ``STABLE`` file (itself written by
``os.replace``), written last. The marker lists every file of the folder with its size and sha256, so a
reader can tell a complete folder from a damaged one (a truncated file, flipped bytes, a file gone):
``verify`` names the first file that does not match. Readers only trust folders that carry ``STABLE``:
the rename alone is atomic on a local disk, the marker keeps the contract on shared filesystems where a
directory rename is not a guarantee that every file inside is visible. Never a half-written folder.

Removal is the mirror image: a folder is renamed to a hidden trash name of its own, then deleted, so a
reader never finds a half-deleted folder under a step name. A process killed at any instant leaves one of
a few states (a staging folder, a trash folder, a renamed folder without its marker yet), each of which
``finish_interrupted`` completes at the next start, and none of which a later rename can trip over: trash
names are unique, so a leftover never blocks the next removal of the same step.

Used for published weights (``weights/step_k``) and trainer checkpoints (``checkpoints/step_k``).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from primebuild.contracts.run_dir import STEP_NAME, step_folder
from primebuild.errors import UserError
from primebuild.hashing import sha256_file

if TYPE_CHECKING:  # readers of step folders (the orchestrator, `verify`) never load torch
    import torch

    from .stream import StreamedWeights

log = logging.getLogger("primebuild.weight_sync")

STABLE = "STABLE"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def staging_dir(final: str | os.PathLike) -> Path:
    """Deterministic hidden sibling of ``final`` (so every rank of a job agrees on it without talking)."""
    final = Path(final)
    return final.parent / f".{final.name}.staging"


def trash_dir(folder: str | os.PathLike) -> Path:
    """A fresh hidden sibling to move ``folder`` to before deleting it. Unique, because a process killed
    while deleting leaves its trash behind, and renaming a folder onto a non-empty one fails (ENOTEMPTY)."""
    folder = Path(folder)
    return folder.parent / f".{folder.name}.trash-{secrets.token_hex(4)}"


# What a killed writer or remover leaves beside the step folders (names from staging_dir and trash_dir).
_UNFINISHED = re.compile(r"^\.step_\d+\.(staging|trash(-[0-9a-f]+)?)$")


def _delete(path: Path) -> None:
    """Delete a folder nobody reads any more. Best effort: what is left (a file still open on a network
    filesystem) is a trash folder that ``finish_interrupted`` deletes at the next start."""
    shutil.rmtree(path, ignore_errors=True)


def discard(folder: str | os.PathLike) -> None:
    """Remove a step folder: renamed away first, so a reader never finds it half-deleted under its step
    name; a folder already gone is no error (a removal that was killed, or repeated)."""
    trash = trash_dir(folder)
    try:
        os.rename(folder, trash)
    except FileNotFoundError:
        return
    _delete(trash)


def finish_interrupted(root: str | os.PathLike) -> list[str]:
    """Complete what a killed process left under ``root`` (only while no process writes there: at the
    start of a session). Returns one line per thing done, for the person resuming.

    - a staging folder: a write that never finished (its marker is written after the rename): deleted;
    - a trash folder: a removal, or the old copy of a replaced step, that was not deleted yet: deleted;
    - the newest step folder without a marker: the writer was killed between its rename and its marker
      (the marker comes right after the rename, so no older folder can be in that state): removed, so
      the step is written again. An older unmarked folder is damage, not a crash: it is left to
      ``latest_verified`` and ``primebuild verify`` to name."""
    root = Path(root)
    if not root.is_dir():
        return []
    done = []
    for path in sorted(root.iterdir()):
        match = _UNFINISHED.match(path.name)
        if match and path.is_dir():
            _delete(path)
            what = "an unfinished write" if match.group(1) == "staging" else "an unfinished removal"
            done.append(f"{'could not delete' if path.exists() else 'deleted'} {root.name}/{path.name} ({what})")
    steps = step_folders(root)
    if steps and not is_stable(step_folder(root, steps[-1])):
        discard(step_folder(root, steps[-1]))
        done.append(f"removed {root.name}/{step_folder(root, steps[-1]).name}: its {STABLE} marker was never "
                    "written (stopped between its rename and its marker)")
    return done


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


class DamagedFolder(UserError):
    """A step folder whose files do not match its STABLE marker (or that has none)."""

    def __init__(self, folder: Path, what: str):
        self.folder, self.what = Path(folder), what
        super().__init__(f"{folder}: {what}", hint="the folder is not used; an earlier verified one is, if any")


def _listing(folder: Path) -> dict[str, dict]:
    """{relative path: {size, sha256}} of every file of the folder but the marker."""
    files = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name not in (STABLE, f".{STABLE}.tmp"):
            files[path.relative_to(folder).as_posix()] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    return files


def _write_marker(folder: Path, payload: dict) -> None:
    tmp = folder / f".{STABLE}.tmp"
    tmp.write_text(json.dumps({**payload, "files": _listing(folder)}, sort_keys=True))
    os.replace(tmp, folder / STABLE)


def _same_files(stage: Path, final: Path) -> bool:
    """Does ``stage`` hold exactly the files, sizes and hashes that ``final``'s STABLE marker lists?"""
    try:
        return json.loads((final / STABLE).read_text())["files"] == _listing(stage)
    except (OSError, ValueError, KeyError, TypeError):
        return False  # no marker (an unfinished folder) or not a listing: write it again


def verify(folder: str | os.PathLike) -> None:
    """Raise DamagedFolder naming the first file that is missing, extra, or not what the marker says."""
    folder = Path(folder)
    try:
        _verify(folder)
    except FileNotFoundError:
        raise  # gone while we read it: retention's, or a damage the caller tells apart
    except OSError as err:  # a file made unreadable
        where = Path(err.filename).relative_to(folder).as_posix() if err.filename and Path(
            err.filename).is_relative_to(folder) else folder.name
        raise DamagedFolder(folder, f"{where}: cannot read it ({err.strerror})") from None


def _verify(folder: Path) -> None:
    marker = folder / STABLE
    if not marker.is_file():
        raise DamagedFolder(folder, f"no {STABLE} marker: the folder was never completed")
    try:
        listed = json.loads(marker.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        listed = None
    if not _is_listing(listed):
        raise DamagedFolder(folder, f"{STABLE}: not a file listing (written by an older primebuild?)")
    present = {p.relative_to(folder).as_posix() for p in folder.rglob("*")
               if p.is_file() and p.name not in (STABLE, f".{STABLE}.tmp")}
    for rel in sorted(set(listed) | present):
        path = folder / rel
        if rel not in present:
            raise DamagedFolder(folder, f"{rel}: missing")
        if rel not in listed:
            raise DamagedFolder(folder, f"{rel}: not listed in {STABLE}")
        size = path.stat().st_size
        if size != listed[rel]["size"]:
            raise DamagedFolder(folder, f"{rel}: {size} bytes, {STABLE} says {listed[rel]['size']} (truncated?)")
        if sha256_file(path) != listed[rel]["sha256"]:
            raise DamagedFolder(folder, f"{rel}: sha256 differs from {STABLE} (the bytes changed)")


def _is_listing(listed: object) -> bool:
    """{relative path: {"size": int, "sha256": str}}, as the marker's writer lists a folder."""
    return isinstance(listed, dict) and all(
        isinstance(entry, dict) and isinstance(entry.get("size"), int) and isinstance(entry.get("sha256"), str)
        for entry in listed.values())


def latest_verified(root: str | os.PathLike, warn: Callable[[str], None] = print) -> tuple[int, Path] | None:
    """The newest step folder under ``root`` that verifies; every newer one that does not is named to
    ``warn`` (a folder still being written lives under its hidden staging name, so it is not seen)."""
    for step in reversed(step_folders(root)):
        folder = step_folder(root, step)
        try:
            verify(folder)
        except DamagedFolder as err:
            warn(f"skipping {err.folder.name}: {err.what}")
            continue
        return step, folder
    return None


def begin(final: str | os.PathLike) -> Path:
    """Create an empty staging folder for ``final`` (removing leftovers of a crashed earlier attempt)."""
    stage = staging_dir(final)
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir(parents=True)
    return stage


def commit(final: str | os.PathLike, step: int | None = None) -> Path:
    """Move the staging folder of ``final`` into place and mark it STABLE. An existing ``final`` (a step
    redone after a resume or a trainer restart) with the very same files is kept as it is: a reader (a
    server loading it) never finds it gone. One that differs is replaced: it disappears for an instant,
    it is never half-written."""
    final = Path(final)
    stage = staging_dir(final)
    _fsync_tree(stage)
    if final.exists() and _same_files(stage, final):
        _delete(stage)
        log.info("%s: written again with the same bytes; the published folder stays", final.name)
        return final
    if final.exists():
        log.info("%s: written again with other bytes (a nondeterministic step?); replaced", final.name)
        trash = trash_dir(final)
        os.rename(final, trash)
        os.rename(stage, final)
        _delete(trash)
    else:
        os.rename(stage, final)
    _write_marker(final, {"step": step, "time": time.time()})
    return final


def publish_dir(final: str | os.PathLike, write: Callable[[Path], None], step: int | None = None) -> Path:
    """Single-writer convenience: ``write(staging)`` fills the folder, then it becomes ``final``."""
    stage = begin(final)
    try:
        write(stage)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return commit(final, step)


def step_folders(root: str | os.PathLike) -> list[int]:
    """Steps of every `step_k` folder under ``root``, complete or not (staging folders are hidden)."""
    root = Path(root)
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := STEP_NAME.match(p.name))) if root.is_dir() else []


def is_stable(folder: str | os.PathLike) -> bool:
    return (Path(folder) / STABLE).is_file()


def stable_steps(root: str | os.PathLike) -> list[int]:
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for p in root.iterdir():
        m = STEP_NAME.match(p.name)
        if m and is_stable(p):
            steps.append(int(m.group(1)))
    return sorted(steps)


def latest_stable(root: str | os.PathLike) -> tuple[int, Path] | None:
    """The newest ``step_k`` folder under ``root`` that carries STABLE, or None."""
    steps = stable_steps(root)
    if not steps:
        return None
    return steps[-1], step_folder(root, steps[-1])


def wait_for_step(root: str | os.PathLike, step: int, timeout_s: float, poll_s: float = 0.1) -> Path:
    """Block until ``step_k`` (or a newer step) is stable; return the folder of the newest such step.
    Raises TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        latest = latest_stable(root)
        if latest is not None and latest[0] >= step:
            return latest[1]
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no stable step >= {step} under {root} after {timeout_s:.0f}s")
        time.sleep(poll_s)


def prune(root: str | os.PathLike, keep_last: int) -> None:
    """Remove all but the newest ``keep_last`` stable step folders."""
    remove_steps(root, stable_steps(root)[:-keep_last] if keep_last > 0 else [])


def remove_steps(root: str | os.PathLike, steps: list[int]) -> None:
    """Remove these step folders (``discard``: renamed away first, then deleted)."""
    for s in steps:
        discard(step_folder(root, s))


def write_hf_folder(
    folder: Path,
    weights: Mapping[str, torch.Tensor] | StreamedWeights,
    config,
    tokenizer_src: str | os.PathLike | None,
    max_shard_bytes: int | None = None,
) -> None:
    """Write ``config.json``, ``model.safetensors`` and the base model's tokenizer files into ``folder``.
    ``config`` is a transformers PretrainedConfig; its ``dtype`` is set to the tensors' dtype. Streamed
    weights are written as they come (safetensors_stream.py): one group in memory at a time. With
    ``max_shard_bytes`` the weights are cut into shards with an index above that size (an export:
    a step folder stays one file, which the servers' reload reads)."""
    from .safetensors_stream import write_safetensors, write_sharded_safetensors
    from .stream import as_stream

    weights = as_stream(weights)
    config = copy.deepcopy(config)
    dtypes = {spec.dtype for spec in weights.layout if spec.dtype.is_floating_point}
    if len(dtypes) == 1:
        config.dtype = next(iter(dtypes))
    config.save_pretrained(folder)
    if max_shard_bytes is None:
        write_safetensors(folder / "model.safetensors", weights, metadata={"format": "pt"})
    else:
        write_sharded_safetensors(folder, weights, max_shard_bytes, metadata={"format": "pt"})
    if tokenizer_src is not None:
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_src) / name
            if src.is_file():
                shutil.copy2(src, folder / name)


def publish_hf_weights(
    weights_dir: str | os.PathLike,
    step: int,
    weights: Mapping[str, torch.Tensor] | StreamedWeights,
    config,
    tokenizer_src: str | os.PathLike | None = None,
) -> Path:
    """Publish ``weights_dir/step_{k:06d}`` in HF layout, atomically."""
    return publish_dir(step_folder(weights_dir, step), lambda d: write_hf_folder(d, weights, config, tokenizer_src), step)
