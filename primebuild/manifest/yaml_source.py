"""Safe YAML reading that remembers where every value came from.

PyYAML's `safe_load` forgets line numbers, silently keeps the last of two duplicate keys and expands
alias bombs without limit. We compose the node graph with PyYAML (which never executes anything at
that stage) and build plain Python values ourselves, so that we can:

- refuse any tag outside YAML's core schema (`!!python/object`, custom `!tags`) instead of running it;
- report duplicate keys, tabs used for indentation, non-UTF-8 bytes and absurd nesting precisely;
- bound the work spent expanding aliases (a "billion laughs" document stops after a fixed budget);
- record `path -> (line, column)` for every key and value, so schema errors point at the right line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from primebuild.errors import Problem, UserError

MAX_DEPTH = 64
MAX_EXPANDED_NODES = 200_000  # every value visited while expanding aliases counts once
MAX_BYTES = 8 * 1024 * 1024

_CORE = "tag:yaml.org,2002:"
_SCALAR_TAGS = {f"{_CORE}{t}" for t in ("str", "int", "float", "bool", "null", "timestamp")}
_MAP_TAG, _SEQ_TAG, _MERGE_TAG = f"{_CORE}map", f"{_CORE}seq", f"{_CORE}merge"

Path_ = tuple[str | int, ...]


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader (YAML 1.1) plus YAML 1.2's floats without a dot: `lr: 1e-6` is a number, as a
    person writing it means (1.1 reads it as the string "1e-6", which the schema would refuse)."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"),
                              list("-+0123456789"))
_PLAIN = "manifests are plain data: remove the tag"


@dataclass
class SourceMap:
    """Where each value of a document came from: path -> (file, line, column), all 1-based."""

    locations: dict[Path_, tuple[str, int, int]] = field(default_factory=dict)
    # problems that do not stop reading (duplicate keys, refused tags): reported with schema errors
    problems: list[Problem] = field(default_factory=list)

    def locate(self, path: Path_) -> tuple[str | None, int | None, int | None]:
        """The location of `path`, or of its nearest ancestor that has one."""
        for cut in range(len(path), -1, -1):
            hit = self.locations.get(tuple(path[:cut]))
            if hit:
                return hit
        return None, None, None

    def problem(self, path: Path_, message: str, hint: str | None = None) -> Problem:
        file, line, col = self.locate(path)
        return Problem(message, file=file, line=line, column=col, field=dotted(path) or None, hint=hint)


def dotted(path: Path_) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def read_text(path: Path) -> str:
    """Read a manifest as UTF-8, reporting a bad byte by line and column."""
    shown = str(path)
    if path.exists() and not path.is_dir() and not path.is_file():  # a pipe or a device would block or never end
        raise UserError(Problem("is a pipe or a device, not a manifest file", file=shown))
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise UserError(Problem("file not found", file=shown, hint="check the path")) from None
    except IsADirectoryError:
        raise UserError(Problem("is a directory, not a manifest file", file=shown)) from None
    except OSError as err:
        raise UserError(Problem(f"cannot read: {err.strerror}", file=shown)) from None
    if len(raw) > MAX_BYTES:
        raise UserError(Problem(f"file is {len(raw)} bytes; manifests are limited to {MAX_BYTES}", file=shown))
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        before = raw[: err.start]
        line = before.count(b"\n") + 1
        col = err.start - (before.rfind(b"\n") + 1) + 1
        raise UserError(
            Problem(
                f"byte 0x{raw[err.start]:02x} is not valid UTF-8",
                file=shown,
                line=line,
                column=col,
                hint="save the file as UTF-8",
            )
        ) from None


def parse_yaml(text: str, file: str) -> tuple[object, SourceMap]:
    """Parse one YAML document into plain Python values plus a source map."""
    tab_problems = [
        Problem("tab character used for indentation", file=file, line=n, column=ln.index("\t") + 1,
                hint="YAML indents with spaces only; replace the tab with spaces")
        for n, ln in enumerate(text.splitlines(), start=1)
        if "\t" in ln[: len(ln) - len(ln.lstrip(" \t"))]
    ]
    if tab_problems:
        raise UserError(tab_problems)
    try:
        nodes = list(yaml.compose_all(text, Loader=_Loader))
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        message = f"YAML syntax error: {err.problem or err.context}"
        if err.context and err.problem:
            message += f" ({err.context})"
        raise UserError(
            Problem(message, file=file, line=mark.line + 1 if mark else None,
                    column=mark.column + 1 if mark else None)
        ) from None
    except yaml.reader.ReaderError as err:  # a character YAML does not allow (a NUL, a control character)
        before = text[: err.position]
        code = err.character if isinstance(err.character, int) else ord(err.character)
        raise UserError(Problem(f"character U+{code:04X} is not allowed in YAML", file=file,
                                line=before.count("\n") + 1, column=err.position - (before.rfind("\n") + 1) + 1,
                                hint="remove it (a manifest is plain text)")) from None
    except yaml.YAMLError as err:
        raise UserError(Problem(f"YAML error: {err}", file=file)) from None
    except RecursionError:
        raise UserError(Problem(f"document nests deeper than {MAX_DEPTH} levels", file=file)) from None
    if len(nodes) > 1:
        second = nodes[1].start_mark
        raise UserError(
            Problem("more than one YAML document ('---') in a manifest", file=file, line=second.line + 1,
                    hint="keep one document per file; compose files with `extends:`")
        )
    if not nodes or nodes[0] is None:
        raise UserError(Problem("the manifest is empty", file=file, hint="start with `apiVersion: primebuild/v1`"))
    builder = _Builder(file)
    value = builder.build(nodes[0], (), 0)
    if value is None and builder.problems:  # the whole document was refused (a tag on it): say why, not "None"
        raise UserError(builder.problems)
    builder.source.problems = builder.problems
    return value, builder.source


class _Builder:
    def __init__(self, file: str):
        self.file = file
        self.source = SourceMap()
        self.problems: list[Problem] = []
        self.expanded = 0
        self.scalars = SafeConstructor()

    def _at(self, node: Node, message: str, path: Path_, hint: str | None = None) -> Problem:
        return Problem(message, file=self.file, line=node.start_mark.line + 1,
                       column=node.start_mark.column + 1, field=dotted(path) or None, hint=hint)

    def build(self, node: Node, path: Path_, depth: int) -> object:
        self.expanded += 1
        if self.expanded > MAX_EXPANDED_NODES:
            raise UserError(self._at(node, f"document expands to more than {MAX_EXPANDED_NODES} values "
                                     "(alias bomb?)", path, hint="avoid deeply repeated aliases"))
        if depth > MAX_DEPTH:
            raise UserError(self._at(node, f"document nests deeper than {MAX_DEPTH} levels", path))
        self.source.locations.setdefault(path, (self.file, node.start_mark.line + 1, node.start_mark.column + 1))
        if isinstance(node, ScalarNode):
            return self._scalar(node, path)
        if isinstance(node, SequenceNode):
            if node.tag != _SEQ_TAG:
                self.problems.append(self._at(node, f"unsupported YAML tag {node.tag!r}", path, hint=_PLAIN))
                return None
            return [self.build(child, (*path, i), depth + 1) for i, child in enumerate(node.value)]
        if isinstance(node, MappingNode):
            if node.tag != _MAP_TAG:
                self.problems.append(self._at(node, f"unsupported YAML tag {node.tag!r}", path, hint=_PLAIN))
                return None
            return self._mapping(node, path, depth)
        self.problems.append(self._at(node, "unsupported YAML node", path))
        return None

    def _scalar(self, node: ScalarNode, path: Path_) -> object:
        if node.tag not in _SCALAR_TAGS:
            self.problems.append(self._at(node, f"unsupported YAML tag {node.tag!r}", path, hint=_PLAIN))
            return None
        if node.tag.endswith(":timestamp"):
            return node.value  # keep dates as written; no field needs a datetime
        kind = node.tag.rsplit(":", 1)[1]
        return getattr(self.scalars, f"construct_yaml_{kind}")(node)

    def _mapping(self, node: MappingNode, path: Path_, depth: int) -> dict:
        out: dict = {}
        seen: dict[str, int] = {}
        merged: dict = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                for source in value_node.value if isinstance(value_node, SequenceNode) else [value_node]:
                    value = self.build(source, path, depth + 1)
                    if not isinstance(value, dict):
                        self.problems.append(self._at(source, "`<<` merges only mappings", path))
                        continue
                    for k, v in value.items():
                        merged.setdefault(k, v)
                continue
            if not isinstance(key_node, ScalarNode) or key_node.tag not in _SCALAR_TAGS:
                self.problems.append(self._at(key_node, "mapping keys must be plain strings", path))
                continue
            key = str(self._scalar(key_node, path))
            if key in seen:
                self.problems.append(self._at(key_node, f"duplicate key {key!r} (first defined on line {seen[key]})",
                                              (*path, key), hint="remove one of the two"))
                continue
            seen[key] = key_node.start_mark.line + 1
            child_path = (*path, key)
            self.source.locations[child_path] = (self.file, key_node.start_mark.line + 1,
                                                 key_node.start_mark.column + 1)
            out[key] = self.build(value_node, child_path, depth + 1)
        for k, v in merged.items():
            out.setdefault(k, v)
        return out
