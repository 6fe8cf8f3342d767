"""User-facing errors.

A `UserError` is the user's to fix (bad manifest, bad flag, infeasible plan): the CLI prints it without
a traceback and exits 2. Anything else is our bug: exit 1, traceback only with `--debug`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Problem:
    """One thing wrong with an input, located as precisely as we can."""

    message: str
    file: str | None = None
    line: int | None = None  # 1-based
    column: int | None = None  # 1-based
    field: str | None = None  # dotted path inside the document, e.g. "trainer.dp_shard"
    hint: str | None = None

    def render(self) -> str:
        where = ""
        if self.file:
            where = self.file
            if self.line is not None:
                where += f":{self.line}"
                if self.column is not None:
                    where += f":{self.column}"
            where += ": "
        path = f"{self.field}: " if self.field else ""
        text = f"{where}{path}{self.message}"
        if self.hint:
            text += f"\n    hint: {self.hint}"
        return text


@dataclass
class UserError(Exception):
    """One or more problems the user can fix; exit code 2."""

    problems: list[Problem] = field(default_factory=list)

    def __init__(self, problems: list[Problem] | Problem | str, *, hint: str | None = None):
        if isinstance(problems, str):
            problems = [Problem(problems, hint=hint)]
        elif isinstance(problems, Problem):
            problems = [problems]
        self.problems = list(problems)
        super().__init__(self.render())

    def render(self) -> str:
        return "\n".join(p.render() for p in self.problems)

    def __str__(self) -> str:
        return self.render()
