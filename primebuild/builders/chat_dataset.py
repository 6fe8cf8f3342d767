"""Chat datasets for SFT: JSONL or Parquet rows `{"messages": [{"role": ..., "content": ...}, ...]}`.

Read and checked here, without torch, so `plan` names a bad row (file, line, what is wrong) before
anything runs; the SFT trainer (primebuild/runtime/trainer/sft.py) reads the same rows through this module.
A row is a chat when it has a non-empty `messages` list of objects with a known `role` and a string
`content`, and at least one assistant turn (the only turns the loss trains on); an optional `tools` list
(OpenAI's shape) is handed to the chat template, as the orchestrator hands it a task's tools.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from primebuild.errors import Problem, UserError

ROLES = ("system", "user", "assistant", "tool")
FORMATS = {".jsonl": "jsonl", ".parquet": "parquet"}
MAX_PROBLEMS = 10  # a broken file names its first few bad rows, not thousands


def dataset_format(path: Path) -> str:
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise UserError(f"{path}: a chat dataset is a .jsonl or .parquet file",
                        hint="convert it to JSON lines of {\"messages\": [...]} or to Parquet with a messages column")
    return fmt


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def chat_problem(row) -> str | None:
    """What makes `row` not a chat, or None."""
    if not isinstance(row, dict):
        return f"a row is a JSON object with a `messages` list, not {type(row).__name__}"
    messages = row.get("messages")
    if messages is None:
        return f"no `messages` field (fields: {', '.join(sorted(row)) or 'none'})"
    if not isinstance(messages, list) or not messages:
        return "`messages` is not a non-empty list"
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"messages[{i}] is not an object with role and content"
        role = message.get("role")
        if role not in ROLES:
            return f"messages[{i}].role is {role!r}; use one of {', '.join(ROLES)}"
        if not isinstance(message.get("content"), str):
            return f"messages[{i}].content is {type(message.get('content')).__name__}, not a string"
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant message: nothing to learn (the loss is on assistant turns only)"
    tools = row.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        return "`tools` is not a list of tool objects (OpenAI's shape, as the chat template reads it)"
    return None


def _jsonl_rows(path: Path):
    """(line number, parsed row or a problem string) of every non-blank line."""
    try:
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    yield number, json.loads(line), None
                except json.JSONDecodeError as err:
                    yield number, None, f"not JSON ({err.msg} at column {err.colno})"
    except UnicodeDecodeError as err:
        raise UserError(f"{path}: not UTF-8 text ({err.reason})", hint="JSONL is UTF-8 text, one JSON object a line") from None
    except OSError as err:
        raise UserError(f"{path}: cannot read it ({err.strerror})") from None


def _parquet_rows(path: Path):
    """(row number, 1-based, row) of a Parquet file; `messages` comes back as a list of dicts."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several types for a file that is not Parquet
        raise UserError(f"{path}: not a readable Parquet file ({type(err).__name__}: {err})") from None
    for number, row in enumerate(table.to_pylist(), start=1):
        yield number, row, None


def read_chats(path: str | Path) -> list[dict]:
    """Every row as {"messages": [...], "tools": [...] or None}; a UserError naming each bad row (its line
    in JSONL, its row in Parquet)."""
    path = Path(path)
    if not path.is_file():
        what = "not a file" if path.exists() else "no such dataset file"
        raise UserError(f"{path}: {what}", hint="sft.dataset.path is relative to the manifest")
    fmt = dataset_format(path)
    unit = "line" if fmt == "jsonl" else "row"
    rows = _jsonl_rows(path) if fmt == "jsonl" else _parquet_rows(path)
    chats, problems = [], []
    for number, row, problem in rows:
        problem = problem or chat_problem(row)
        if problem is not None:
            problems.append(Problem(f"{unit} {number} is not a chat: {problem}", file=str(path),
                                    line=number if fmt == "jsonl" else None,
                                    hint='a row is {"messages": [{"role": "user", "content": "..."}, '
                                         '{"role": "assistant", "content": "..."}]}'))
            if len(problems) >= MAX_PROBLEMS:
                break
            continue
        chats.append({"messages": [{"role": m["role"], "content": m["content"]} for m in row["messages"]],
                      "tools": row.get("tools")})
    if problems:
        raise UserError(problems)
    if not chats:
        raise UserError(f"{path}: the dataset has no rows", hint="give at least one chat per line")
    return chats
