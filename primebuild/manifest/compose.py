"""Manifest composition: `extends:` files and `--set path=value` overrides.

Rules, chosen to be unsurprising: mappings merge key by key, everything else (lists included) is
replaced by the later value. Files named in `extends:` are merged in order, then the manifest itself
on top, then `--set` overrides. The source map follows the value that won, so errors still point at
the file and line the value really came from.
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import BaseModel

from primebuild.errors import Problem, UserError
from primebuild.manifest.schema import Manifest
from primebuild.manifest.yaml_source import Path_, SourceMap, parse_yaml, read_text

MAX_EXTENDS_DEPTH = 16


def load_composed(path: Path, *, display: str | None = None, _chain: tuple[Path, ...] = ()) -> tuple[dict, SourceMap, list[Path]]:
    """Read `path`, resolve its `extends:` chain, and return (document, source map, files read)."""
    resolved = path.resolve()
    shown = display or str(path)
    if resolved in _chain:
        cycle = " -> ".join(str(p) for p in (*_chain, resolved))
        raise UserError(Problem(f"`extends:` cycle: {cycle}", file=shown, field="extends",
                                hint="remove one of the references"))
    if len(_chain) >= MAX_EXTENDS_DEPTH:
        raise UserError(Problem(f"`extends:` chain longer than {MAX_EXTENDS_DEPTH}", file=shown, field="extends"))
    doc, source = parse_yaml(read_text(path), shown)
    if not isinstance(doc, dict):
        raise UserError(Problem(f"a manifest must be a mapping of fields, not a {type(doc).__name__}",
                                file=shown, line=1, hint="start with `apiVersion: primebuild/v1`"))
    parents = doc.pop("extends", None)
    if parents is None:
        return doc, source, [resolved]
    as_list = isinstance(parents, list)
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise UserError(source.problem(("extends",), "`extends:` must be a file name or a list of file names"))
    merged: dict = {}
    merged_source = SourceMap()
    files: list[Path] = []
    for i, parent in enumerate(parents):
        parent_path = path.parent / parent
        if not parent_path.is_file():
            raise UserError(source.problem(("extends", i), f"extended file not found: {parent_path}",
                                           hint="paths in `extends:` are relative to the manifest that names them"))
        shown_parent = str(Path(shown).parent / parent)
        if parent_path.resolve() in (*_chain, resolved):  # report the cycle where the looping entry is written
            cycle = " -> ".join(str(f) for f in (*_chain, resolved, parent_path.resolve()))
            raise UserError(source.problem(("extends", i) if as_list else ("extends",),
                                           f"`extends:` cycle: {cycle}", hint="remove one of the references"))
        parent_doc, parent_source, parent_files = load_composed(parent_path, display=shown_parent,
                                                                _chain=(*_chain, resolved))
        merged = deep_merge(merged, parent_doc, merged_source, parent_source, ())
        merged_source.problems += parent_source.problems
        files += parent_files
    merged = deep_merge(merged, doc, merged_source, source, ())
    merged_source.locations[()] = source.locations.get((), (shown, 1, 1))
    merged_source.problems += source.problems
    return merged, merged_source, [*files, resolved]


def deep_merge(base: dict, top: dict, base_source: SourceMap, top_source: SourceMap, path: Path_) -> dict:
    """Merge `top` over `base`; `base_source` is updated in place to describe the result."""
    out = dict(base)
    for key, value in top.items():
        child = (*path, key)
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value, base_source, top_source, child)
        else:
            out[key] = value
            for loc_path in [p for p in base_source.locations if p[: len(child)] == child]:
                del base_source.locations[loc_path]
            for loc_path, loc in top_source.locations.items():
                if loc_path[: len(child)] == child:
                    base_source.locations[loc_path] = loc
        if child not in base_source.locations and child in top_source.locations:
            base_source.locations[child] = top_source.locations[child]
    return out


def apply_sets(doc: dict, sets: list[str], source: SourceMap) -> dict:
    """Apply `--set a.b.c=value` overrides; the value is parsed as a YAML scalar or flow collection."""
    out = doc
    for index, item in enumerate(sets):
        where = f"--set #{index + 1}"
        if "=" not in item:
            raise UserError(Problem(f"expected PATH=VALUE, got {item!r}", file=where,
                                    hint="e.g. --set trainer.dp_shard=16"))
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise UserError(Problem(f"bad field path {key!r}", file=where, hint="e.g. --set trainer.dp_shard=16"))
        node: object = out
        for depth, part in enumerate(parts[:-1]):  # --set names fields; a list is set whole
            node = node.get(part) if isinstance(node, dict) else None
            if isinstance(node, list) or "[" in part:
                name = ".".join(parts[: depth + 1]).split("[")[0]
                raise UserError(Problem(f"{key}: {name} is a list, and --set cannot reach into one of its items",
                                        file=where, hint=f"set the whole list: --set '{name}=[{{...}}, ...]'"))
        try:
            value, parsed = parse_yaml(raw, where) if raw.strip() else ("", None)
            if parsed is not None and parsed.problems:
                value = raw
        except UserError:
            value = raw  # not valid YAML on its own: take it as a plain string
        if isinstance(value, (bool, int, float)) and _holds_text(parts):
            value = raw.strip()  # typed by the schema: `--set image.python=3.12` means the text "3.12"
        out = _set_path(out, parts, value)
        for loc_path in [p for p in source.locations if p[: len(parts)] == tuple(parts)]:
            del source.locations[loc_path]
        source.locations[tuple(parts)] = ("--set", None, None)  # type: ignore[assignment]
    return out


def _set_path(doc: dict, parts: list[str], value: object) -> dict:
    out = dict(doc)
    head, rest = parts[0], parts[1:]
    if not rest:
        out[head] = value
        return out
    child = out.get(head)
    out[head] = _set_path(child if isinstance(child, dict) else {}, rest, value)
    return out


def _holds_text(parts: list[str]) -> bool:
    """Whether the schema field at `parts` takes only text (str, a Literal of strings, or either or None)."""
    models: list[object] = [Manifest]
    annotation: object = None
    for part in parts:
        found = [m.model_fields[part] for m in models if part in getattr(m, "model_fields", {})]
        if not found:
            return False
        annotation = found[0].annotation
        models = [a for a in _alternatives(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
    options = [a for a in _alternatives(annotation) if a is not type(None)]
    return bool(options) and all(
        a is str or (typing.get_origin(a) is Literal and all(isinstance(v, str) for v in typing.get_args(a)))
        for a in options)


def _alternatives(annotation: object) -> list[object]:
    """The types a field admits: unions flattened, Annotated unwrapped."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _alternatives(typing.get_args(annotation)[0])
    if origin is Union or origin is types.UnionType:
        return [x for arg in typing.get_args(annotation) for x in _alternatives(arg)]
    return [annotation]
