"""The plan's `model` section: where the weights come from (as the manifest names them) and the
architecture facts the plan was compiled against."""

from __future__ import annotations

from typing import Literal

from pydantic import model_serializer

from primebuild.contracts.base import Contract

# The keys each source writes, besides `source`, `dtype` and the facts (primebuild/builders/model_ref.py).
SOURCE_KEYS = {"hf": ("repo", "revision"), "path": ("path",), "from_manifest": ("manifest",),
               "from_run": ("run", "step"), "init": ("init", "tokenizer")}
_SOURCE_SPECIFIC = {key for keys in SOURCE_KEYS.values() for key in keys}


class ModelRef(Contract):
    source: Literal["hf", "path", "from_manifest", "from_run", "init"]
    dtype: str
    repo: str | None = None  # hf
    revision: str | None = None  # hf: as the manifest gives it (the lock pins the commit)
    path: str | None = None  # path
    manifest: str | None = None  # from_manifest: the manifest whose output model this run starts from
    run: str | None = None  # from_run: the run folder (as the manifest writes it) whose policy this run starts from
    step: int | None = None  # from_run: its checkpoint step (None: the newest complete one when planned)
    init: str | None = None  # init: how the fresh weights are made
    tokenizer: str | None = None  # init
    facts: str | None = None  # the architecture file the manifest names (absent: the default one)
    total_params: int
    active_params: int
    architecture: str

    @model_serializer(mode="wrap")
    def _only_this_sources_keys(self, handler):
        # Each source writes its own keys (init writes a null tokenizer) and `facts` only when named: the
        # JSON (and the hashes) the section had as a dict.
        data = handler(self)
        drop = _SOURCE_SPECIFIC - set(SOURCE_KEYS[self.source])
        return {k: v for k, v in data.items() if k not in drop and not (k == "facts" and v is None)}

