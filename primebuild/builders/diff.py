"""Field-by-field differences between two JSON-like values, named by dotted paths.

`diff_values(a, b)` walks both values together and returns one `Change` per leaf that differs:
`trainer.optimizer.lr: 0.0002 -> 0.001`, `+ environments.math` (added), `- model.path` (removed).
Lists whose items are all mappings with a unique `name` (or `id`) are matched by that key, so that
inserting one process does not report every later process as changed (`processes[trainer-0].argv`);
other lists are compared item by item, and lists of plain values as one value.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

_MISSING = object()
_MATCH_KEYS = ("name", "id")


@dataclass(frozen=True)
class Change:
    path: str
    old: Any = _MISSING
    new: Any = _MISSING

    @property
    def kind(self) -> str:
        if self.old is _MISSING:
            return "added"
        if self.new is _MISSING:
            return "removed"
        return "changed"

    def to_json(self) -> dict:
        out: dict = {"path": self.path, "kind": self.kind}
        if self.old is not _MISSING:
            out["old"] = self.old
        if self.new is not _MISSING:
            out["new"] = self.new
        return out

    def render(self, width: int = 120) -> str:
        if self.kind == "added":
            return f"+ {self.path}: {_short(self.new, width)}"
        if self.kind == "removed":
            return f"- {self.path}: {_short(self.old, width)}"
        return f"~ {self.path}: {_short(self.old, width)} -> {_short(self.new, width)}"


def diff_values(old: Any, new: Any, path: str = "") -> list[Change]:
    if isinstance(old, dict) and isinstance(new, dict):
        changes = []
        for key in sorted(set(old) | set(new), key=str):
            sub = _join(path, str(key))
            if key not in new:
                changes.append(Change(sub, old=old[key]))
            elif key not in old:
                changes.append(Change(sub, new=new[key]))
            else:
                changes += diff_values(old[key], new[key], sub)
        return changes
    if isinstance(old, list) and isinstance(new, list) and old != new:
        key = _match_key(old, new)
        if key is not None:
            return diff_values({str(i[key]): i for i in old}, {str(i[key]): i for i in new}, path + "[]")
        if any(isinstance(i, dict | list) for i in old + new):
            changes = []
            for i in range(max(len(old), len(new))):
                sub = f"{path}[{i}]"
                if i >= len(new):
                    changes.append(Change(sub, old=old[i]))
                elif i >= len(old):
                    changes.append(Change(sub, new=new[i]))
                else:
                    changes += diff_values(old[i], new[i], sub)
            return changes
    if old == new and type(old) is type(new):
        return []
    return [Change(path or "(value)", old=old, new=new)]


def render_changes(changes: list[Change], width: int = 120) -> str:
    return "\n".join(c.render(width) for c in changes)


def _join(path: str, key: str) -> str:
    if path.endswith("[]"):
        return f"{path[:-2]}[{key}]"
    return f"{path}.{key}" if path else key


def _match_key(old: list, new: list) -> str | None:
    items = old + new
    if not items or not all(isinstance(i, dict) for i in items):
        return None
    for key in _MATCH_KEYS:
        if all(key in i for i in items) and all(
            len({str(i[key]) for i in side}) == len(side) for side in (old, new)
        ):
            return key
    return None


def _short(value: Any, width: int) -> str:
    text = json.dumps(value, sort_keys=True, ensure_ascii=False) if not isinstance(value, str) else value
    if isinstance(value, list) and len(text) > width:
        return f"[{len(value)} items]"
    if isinstance(value, dict) and len(text) > width:
        return f"{{{len(value)} fields}}"
    return text if len(text) <= width else text[: width - 1] + "…"
