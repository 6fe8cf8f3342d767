"""Load a manifest: read, compose, migrate, validate. Every problem is reported at once, located."""

from __future__ import annotations

import difflib
import shlex
import typing
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ValidationError

from primebuild.contracts.plan import PLACEHOLDER
from primebuild.errors import Problem, UserError
from primebuild.hashing import sha256_json
from primebuild.manifest.compose import apply_sets, load_composed
from primebuild.manifest.schema import FIELD_SEP, LOSS_NAMES, Manifest
from primebuild.manifest.versions import check_and_migrate, move_fields
from primebuild.manifest.yaml_source import Path_, SourceMap


@dataclass(frozen=True)
class LoadedManifest:
    manifest: Manifest
    path: Path  # the manifest file as given
    files: list[Path]  # every file read (extends chain included), resolved
    document: dict  # the composed document, before defaults
    source: SourceMap = field(repr=False)
    notes: list[str] = field(default_factory=list)  # migration notes to show the user
    sets: tuple[str, ...] = ()  # the --set overrides it was loaded with (a fix a message suggests repeats them)

    @property
    def command_args(self) -> str:
        """The manifest and its overrides as a command names them, shell-quoted."""
        return " ".join(shlex.quote(a) for a in [str(self.path), *(x for s in self.sets for x in ("--set", s))])

    @property
    def manifest_hash(self) -> str:
        """sha256 of the validated manifest with defaults filled in: formatting and comments don't count."""
        return sha256_json(self.manifest.model_dump(mode="json"))

    def resolve(self, relative: str, field: Path_ = ()) -> Path:
        """A path written at `field`, relative to the folder of the file that writes it: a path in an
        `extends:` parent is relative to that parent, as `extends:` itself is; a `--set` one, to the manifest's."""
        written_in, _, _ = self.source.locate(field) if field else (None, None, None)
        folder = Path(written_in).parent if written_in and Path(written_in).is_file() else self.path.parent
        return (folder / relative).resolve()


def load_manifest(path: str | Path, sets: list[str] | tuple[str, ...] = ()) -> LoadedManifest:
    path = Path(path)
    shown = str(path)
    doc, source, files = load_composed(path, display=shown)
    doc, notes = check_and_migrate(doc, source, shown)
    if sets:
        doc = apply_sets(doc, list(sets), source)
    doc, moved = move_fields(doc, source, shown)  # after --set, so `--set orchestrator.lr=...` moves too
    notes += moved
    try:
        manifest = Manifest.model_validate(doc)
    except ValidationError as err:
        # a refused tag leaves None behind: its "should be a string" would only repeat the real problem
        reported = {p.field for p in source.problems}
        schema = [p for p in validation_problems(err, source, doc) if p.field not in reported]
        raise UserError(_sorted(source.problems + schema)) from None
    if source.problems:
        raise UserError(_sorted(source.problems))
    if placeholders := list(_placeholders(doc, (), source)):
        raise UserError(_sorted(placeholders))
    return LoadedManifest(manifest=manifest, path=path, files=files, document=doc, source=source, notes=notes,
                          sets=tuple(sets))


def validation_problems(err: ValidationError, source: SourceMap, doc: object = None) -> list[Problem]:
    problems = []
    for e in err.errors(include_url=False):
        path = _clean_loc(e["loc"])
        kind = e["type"]
        if kind == "extra_forbidden":
            name = str(path[-1])
            known = _fields_at(Manifest, path[:-1], doc)
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else (
                f"known fields here: {', '.join(sorted(known))}" if known else None)
            problems.append(source.problem(path, f"unknown field {name!r}", hint=hint))
        elif kind == "missing":
            problems.append(source.problem(path, "required field is missing"))
        elif kind == "literal_error":
            expected = e.get("ctx", {}).get("expected", "")
            problems.append(source.problem(path, f"got {e.get('input')!r}; expected one of {expected}"))
        elif kind == "union_tag_invalid" or kind == "union_tag_not_found":
            tag, tags = UNION_TAGS.get(str(path[-1]) if path else "", ("kind", ()))
            problems.append(source.problem(path, e["msg"], hint=f"{tag} is one of {', '.join(tags)}"))
        else:
            msg = e["msg"].removeprefix("Value error, ")
            if FIELD_SEP in msg:  # schema.at(): a check across fields, located at one of them, with its fix
                name, msg, hint = msg.split(FIELD_SEP)
                problems.append(source.problem((*path, name), msg, hint=hint or None))
            else:
                problems.append(source.problem(path, msg))
    return problems


def _placeholders(value: object, path: tuple, source: SourceMap):
    """A problem for each string that holds a plan placeholder: the worker would fill it in as if the plan
    had written it (a tag `{python}` became the interpreter's path, `{bind:7}` failed the start)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _placeholders(item, (*path, key), source)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _placeholders(item, (*path, i), source)
    elif isinstance(value, str) and (found := PLACEHOLDER.search(value)):
        yield source.problem(path, f"{found.group(0)} is a placeholder each process fills in at start; manifest "
                             "text cannot hold one", hint="write it another way (e.g. without the braces)")


def _sorted(problems: list[Problem]) -> list[Problem]:
    return sorted(problems, key=lambda p: (p.file or "", p.line or 0, p.column or 0, p.field or ""))


# discriminated unions of the schema: field name -> (its tag field, the tags)
UNION_TAGS = {"target": ("target.kind", ("local", "ssh", "slurm", "kubernetes")),
              "loss": ("loss.name", LOSS_NAMES)}


def _clean_loc(loc: tuple) -> Path_:
    """Drop pydantic's internal union/tag markers from an error location."""
    out: list = []
    for part in loc:
        if isinstance(part, str) and (part.startswith("function-")
                                      or out and str(out[-1]) in UNION_TAGS and part in UNION_TAGS[str(out[-1])][1]):
            continue
        out.append(part)
    return tuple(out)


def _fields_at(model: type[BaseModel], path: Path_, doc: object = None) -> list[str]:
    """Field names valid at `path` (for did-you-mean hints); `doc` picks the variant of a tagged union."""
    current: object = model
    for part in path:
        if isinstance(doc, dict):
            doc = doc.get(part)
        elif isinstance(doc, list) and isinstance(part, int) and part < len(doc):
            doc = doc[part]
        else:
            doc = None
        if isinstance(part, int):
            continue
        fields = getattr(current, "model_fields", None)
        if not fields or part not in fields:
            return []
        current = _model_of(fields[part].annotation, doc)
    return list(getattr(current, "model_fields", {}))


def _model_of(annotation: object, doc: object = None) -> object:
    """The model class inside an annotation; of a tagged union, the variant whose tag `doc` carries."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    found = [m for m in (_model_of(arg) for arg in getattr(annotation, "__args__", ()) or ()) if m is not None]
    for candidate in found:
        tags = {n: typing.get_args(f.annotation) for n, f in candidate.model_fields.items() if n in ("name", "kind")}
        if isinstance(doc, dict) and any(doc.get(n) in values for n, values in tags.items()):
            return candidate
    return found[0] if found else None
