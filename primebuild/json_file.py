"""Read a JSON file a person may have touched (plan, lock, config, run record): every failure is one
located problem (file:line:col), never a traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from primebuild.errors import Problem, UserError


def read_json(path: str | Path, *, what: str = "file", hint: str | None = None, want_object: bool = False) -> Any:
    """The JSON value in `path`. `what` names the file in messages ("the plan", "the lock"); `hint`
    says how to get a good one; `want_object`: anything but a JSON object is a problem too."""
    path = Path(path)

    def problem(message: str, line: int | None = None, column: int | None = None) -> UserError:
        return UserError(Problem(message, file=str(path), line=line, column=column, hint=hint))

    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise problem(f"{what} not found") from None
    except OSError as err:
        raise problem(f"cannot read {what}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise problem(f"{what} is not UTF-8 text ({err.reason})") from None
    except json.JSONDecodeError as err:
        raise problem(f"not valid JSON: {err.msg}", err.lineno, err.colno) from None
    if want_object and not isinstance(value, dict):
        raise problem(f"{what} must be a JSON object, not {type(value).__name__}")
    return value
