"""On-policy distillation at plan time: the teacher's manifest, its architecture facts, and the check that
it reads the student's tokens the way the student does.

The teacher scores the student's sampled token ids as they are (token in, token out: nothing is
re-tokenised, runtime/orchestrator/teacher.py), so a teacher with another tokenizer would score other
text. The plan refuses it, located at distill.teacher. A tokenizer is named by where it comes from: the
`tokenizer:` a random init builds (char, chat), or the hub repo / folder that ships it, found by following
`from_manifest:` down to the model the chain starts from; and the vocabulary sizes must agree too.
"""

from __future__ import annotations

from primebuild.builders.model_facts import ModelFacts, facts_from_hf_config
from primebuild.builders.model_ref import read_facts_json
from primebuild.errors import UserError
from primebuild.manifest.load import LoadedManifest, load_manifest

TEACHER_FIELD = ("distill", "teacher", "from_manifest")


def teacher_manifest(loaded: LoadedManifest) -> LoadedManifest:
    """The manifest whose output model is the teacher (distill.teacher.from_manifest)."""
    ref = loaded.manifest.distill.teacher.from_manifest  # type: ignore[union-attr]
    path = loaded.resolve(ref, TEACHER_FIELD)
    if not path.is_file():
        raise UserError(loaded.source.problem(TEACHER_FIELD, f"manifest not found: {path}",
                                              hint="the path is relative to the manifest file that writes it"))
    teacher = load_manifest(path)
    if teacher.manifest.sft is None:
        raise UserError(loaded.source.problem(TEACHER_FIELD, f"{ref} builds no model (it has no sft: section)",
                                              hint="name a model-building manifest, e.g. an SFT manifest"))
    return teacher


def tokenizer_source(loaded: LoadedManifest, _depth: int = 0) -> str:
    """Where the tokenizer of a manifest's model comes from (see the module docstring)."""
    model = loaded.manifest.model
    kind = model.source_kind
    if kind == "init":
        return f"init:{model.tokenizer or 'char'}"
    if kind == "hf":
        return f"hf:{model.hf}"
    if kind == "path":
        return f"path:{loaded.resolve(model.path, ('model', 'path'))}"  # type: ignore[arg-type]
    if kind == "from_run" or _depth > 8:  # a run keeps its base model's tokenizer; the facts check still applies
        return f"{kind}:{getattr(model, kind)}"
    return tokenizer_source(load_manifest(loaded.resolve(model.from_manifest, ("model", "from_manifest"))),  # type: ignore[arg-type]
                            _depth + 1)


def teacher_facts(loaded: LoadedManifest, student: ModelFacts) -> tuple[LoadedManifest, ModelFacts]:
    """The teacher's manifest and facts; refuses, located, a teacher whose tokenizer is not the student's."""
    teacher = teacher_manifest(loaded)
    config, shown = read_facts_json(teacher)
    facts = facts_from_hf_config(config, shown)
    mine, theirs = tokenizer_source(loaded), tokenizer_source(teacher)
    if mine != theirs or facts.vocab_size != student.vocab_size:
        raise UserError(loaded.source.problem(
            TEACHER_FIELD, f"the teacher's tokenizer ({theirs}, vocabulary {facts.vocab_size}) is not the student's "
            f"({mine}, vocabulary {student.vocab_size}): it would score other text than the student sampled",
            hint="distil from a teacher built on the student's tokenizer (e.g. the same `tokenizer:` and vocab_size)"))
    return teacher, facts

