"""Resolve what a manifest says about its model: a stable reference and the architecture facts file.

Pure: reads only the files the manifest names. The reference uses paths as written in the manifest
(never absolute ones), so the plan hash does not depend on where the checkout lives.
"""

from __future__ import annotations

from pathlib import Path

from primebuild.builders.model_facts import ModelFacts
from primebuild.contracts.model_ref import ModelRef
from primebuild.errors import Problem, UserError
from primebuild.json_file import read_json
from primebuild.manifest.load import LoadedManifest, load_manifest


def model_reference(loaded: LoadedManifest, facts: ModelFacts) -> ModelRef:
    model = loaded.manifest.model
    kind = model.source_kind
    by_source = {"hf": dict(repo=model.hf, revision=model.revision), "path": dict(path=model.path),
                 "from_manifest": dict(manifest=model.from_manifest),
                 "from_run": dict(run=model.from_run, step=model.step),
                 "init": dict(init=model.init, tokenizer=model.tokenizer)}[kind]
    return ModelRef(source=kind, dtype=model.dtype, **by_source, facts=model.facts,
                    total_params=facts.total_params(), active_params=facts.active_params(),
                    architecture=facts.architecture)


def facts_file(loaded: LoadedManifest, _depth: int = 0) -> tuple[Path, str]:
    """The HF config.json-style file holding the architecture, and how to show it to a person."""
    model = loaded.manifest.model
    if model.from_manifest is not None and loaded.resolve(model.from_manifest, ("model", "from_manifest")) == loaded.path.resolve():
        raise UserError(loaded.source.problem(("model", "from_manifest"), "a manifest cannot start from its own output",
                                              hint="name the manifest that builds the model (e.g. an SFT manifest)"))
    if model.facts is not None:  # `facts: ""` is given (and not found), not absent
        return loaded.resolve(model.facts, ("model", "facts")), model.facts
    kind = model.source_kind
    if kind == "hf":
        name = model.hf.rsplit("/", 1)[-1].lower()  # type: ignore[union-attr]
        return loaded.path.parent.resolve() / "models" / f"{name}.json", f"models/{name}.json"
    if kind == "path":
        return loaded.resolve(model.path, ("model", "path")) / "config.json", f"{model.path}/config.json"  # type: ignore[operator]
    if kind == "from_run":
        return run_config_file(loaded)
    if _depth > 8:
        raise UserError(Problem("model.from_manifest chain is longer than 8", file=str(loaded.path),
                                field="model.from_manifest"))
    parent_path = loaded.resolve(model.from_manifest, ("model", "from_manifest"))  # type: ignore[arg-type]
    if not parent_path.is_file():
        raise UserError(loaded.source.problem(("model", "from_manifest"), f"manifest not found: {parent_path}",
                                              hint="the path is relative to the manifest file that writes it"))
    return facts_file(load_manifest(parent_path), _depth + 1)


def read_facts_json(loaded: LoadedManifest, lock: dict | None = None) -> tuple[dict, str]:
    """The model's config.json (as a dict) and how to name it: the facts file, else for a hub model the
    config its lock fetched into the store (`lock` None: the manifest's own lock file)."""
    path, shown = facts_file(loaded)
    model = loaded.manifest.model
    if not path.is_file() and model.facts is None and model.source_kind == "hf":
        # imported here: hf_configs -> derivations -> this module
        from primebuild.builders.hf_configs import locked_config

        return locked_config(loaded, lock, shown)
    if not path.is_file():
        field = ("model", "facts") if model.facts is not None else ("model",)
        what = "is not a file" if shown and path.exists() else "not found"
        raise UserError(loaded.source.problem(
            field, f"architecture facts {what}: {shown}",
            hint="add the model's config.json under manifests/models/, or set model.facts"))
    return read_json(path, what="config", want_object=True), shown


def run_config_file(loaded: LoadedManifest) -> tuple[Path, str]:
    """A `from_run:` model's config.json: the exported entry's when `primebuild export` (or a run) built
    it already, else the run's base model's, whose architecture the checkpoint shares."""
    from primebuild.builders.export import export_derivation
    from primebuild.builders.store import Store

    model = loaded.manifest.model
    source = export_source_located(loaded)
    store = Store()
    exported = store.root / export_derivation(source, store.root).key
    if (exported / "config.json").is_file():
        return exported / "config.json", f"{exported.name}/config.json (the export of {model.from_run})"
    return Path(source.trainer.model_path) / "config.json", f"{model.from_run}'s base model config.json"


def export_source_located(loaded: LoadedManifest):
    """builders/export.export_source for the manifest's `from_run:`, its errors located at model.from_run."""
    from primebuild.builders.export import export_source

    model = loaded.manifest.model
    try:
        return export_source(loaded.resolve(model.from_run, ("model", "from_run")), model.step,  # type: ignore[arg-type]
                             where="model.from_run")
    except UserError as err:
        field = ("model", "step") if model.step is not None and "checkpoint" in str(err) else ("model", "from_run")
        raise UserError(loaded.source.problem(field, str(err.problems[0].message),
                                              hint=err.problems[0].hint)) from None
