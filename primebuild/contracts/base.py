"""The base of every process config: strict on read, immutable, loaded with located errors."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from primebuild.errors import Problem, UserError
from primebuild.json_file import read_json

C = TypeVar("C", bound="Contract")


class Contract(BaseModel):
    """Unknown keys are errors: a value the compiler writes must have a reader."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def load_contract(cls: type[C], path: str | Path) -> C:
    """Parse a config file written by the worker; every problem names the file and the field."""
    return parse_contract(cls, read_json(path, what="config file"), where=str(path))


def parse_contract(cls: type[C], data: object, *, where: str) -> C:
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise UserError([Problem(e["msg"], file=where, field=".".join(str(x) for x in e["loc"]) or None)
                         for e in err.errors(include_url=False)]) from None
