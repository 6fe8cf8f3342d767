"""Models as derivations: resolve a manifest's model to a local HF folder, building it in the store.

- `init: random` -> a store entry keyed by the architecture facts, tokenizer and seed;
- a manifest with an `sft:` section -> a store entry keyed by that manifest's hash plus its input
  model's store key (so changing the SFT recipe or the init rebuilds, and nothing else does);
- `from_manifest:` -> the output of that manifest, built on first use and reused afterwards;
- `from_run:` -> that run's policy at a checkpoint, exported into the store (primebuild/runtime/export.py);
- `path:` -> the folder itself; `hf:` -> huggingface_hub's snapshot at the given revision.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from primebuild.builders import derivations
from primebuild.builders.store import Store
from primebuild.contracts.sft import ChatSFTConfig
from primebuild.errors import UserError
from primebuild.manifest.load import LoadedManifest, load_manifest


@dataclass
class Resolved:
    path: Path
    cache_hit: bool
    seconds: float
    info: dict


def resolve_model(loaded: LoadedManifest, store: Store, echo=print) -> Resolved:
    """The folder holding the weights this manifest starts from."""
    m = loaded.manifest.model
    kind = m.source_kind
    if kind == "path":
        path = loaded.resolve(m.path, ("model", "path"))  # type: ignore[arg-type]
        if not (path / "config.json").is_file():
            raise UserError(loaded.source.problem(("model", "path"), f"{path} has no config.json",
                                                  hint="point model.path at an HF-layout folder"))
        return Resolved(path, True, 0.0, {"source": "path"})
    if kind == "hf":
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

        started = time.perf_counter()
        try:
            path = Path(snapshot_download(m.hf, revision=m.revision))  # type: ignore[arg-type]
        except (LocalEntryNotFoundError, HfHubHTTPError) as err:  # no network, unknown repo or revision, no access
            raise UserError(loaded.source.problem(
                ("model", "hf"), f"{m.hf}@{m.revision}: the hub's files could not be fetched, and the local hub "
                f"cache does not hold them ({type(err).__name__}: {str(err).splitlines()[0][:200]})",
                hint="check the network and HF_TOKEN (listed in secrets), or download the snapshot into the hub "
                     "cache first (huggingface-cli download), or point model.path at a local folder")) from None
        return Resolved(path, False, time.perf_counter() - started, {"source": "hf", "repo": m.hf})
    if kind == "init":
        return _random_init(loaded, store)
    if kind == "from_run":
        return _from_run(loaded, store, echo)
    parent = load_manifest(loaded.resolve(m.from_manifest, ("model", "from_manifest")))  # type: ignore[arg-type]
    return output_of(parent, store, echo)


def output_of(loaded: LoadedManifest, store: Store, echo=print) -> Resolved:
    """What a manifest produces: the SFT-trained model of an `sft:` manifest."""
    config = derivations.sft_config(loaded)  # raises when the manifest has no `sft:` section
    base = resolve_model(loaded, store, echo)
    derivation = derivations.sft(loaded, _store_ref(store, base.path))
    started = time.perf_counter()
    hit = store.lookup(derivation.key)
    if hit is not None:
        info = json.loads((hit / "sft_metrics.json").read_text())
        return Resolved(hit, True, time.perf_counter() - started, info)
    metrics: dict = {}
    if isinstance(config, ChatSFTConfig):  # the placeholders, resolved
        echo(f"building {loaded.manifest.name} (SFT of {loaded.manifest.sft.dataset.path} on the trainer, "
             f"{config.steps} steps, {config.ranks} rank(s)) into the store …")
        runnable = config.model_copy(update={"model_path": str(base.path),
                                             "dataset_path": str(derivations.dataset_file(loaded))})
    else:
        until = f", until reward {config.stop_at_reward}" if config.stop_at_reward is not None else ""
        echo(f"building {loaded.manifest.name} (SFT of {config.env_id}'s demonstrations on the trainer, at most "
             f"{config.steps} steps{until}, {config.ranks} rank(s)) into the store …")
        runnable = config.model_copy(update={"model_path": str(base.path)})

    def build(out: Path) -> None:
        from primebuild.runtime.sft import run_trainer_sft

        _no_progress_bars()
        model_dir = out / "model-staging"
        result = run_trainer_sft(runnable, str(model_dir), echo)
        _move_contents(model_dir, out)
        metrics.update(result)
        (out / "sft_metrics.json").write_text(json.dumps(result, indent=2, sort_keys=True))

    path = store.build(derivation.name, derivation.inputs, build)
    return Resolved(path, False, time.perf_counter() - started, metrics)


def _random_init(loaded: LoadedManifest, store: Store) -> Resolved:
    m = loaded.manifest.model
    if m.tokenizer not in ("char", "chat"):
        raise UserError(loaded.source.problem(("model", "tokenizer"), f"unknown tokenizer {m.tokenizer!r}",
                                              hint="`init: random` builds tokenizer: char or chat"))
    derivation = derivations.random_init(loaded)
    arch = derivation.inputs["facts"]
    started = time.perf_counter()

    def build(out: Path) -> None:
        from primebuild.runtime.models.char_tokenizer import build_char_tokenizer
        from primebuild.runtime.models.chat_tokenizer import build_chat_tokenizer
        from primebuild.runtime.models.tiny import init_tiny_model, save_hf_folder, tiny_config_from_facts

        _no_progress_bars()
        config = tiny_config_from_facts(arch)
        tokenizer = build_char_tokenizer()
        if m.tokenizer == "chat":  # the chat tokenizer's ids: a turn ends at <|im_end|>, no <bos>
            tokenizer = build_chat_tokenizer()
            config.update({"vocab_size": len(tokenizer), "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id,
                           "pad_token_id": tokenizer.pad_token_id})
        staging = out / "staging"
        save_hf_folder(init_tiny_model(config, loaded.manifest.seed), tokenizer, staging)
        _move_contents(staging, out)

    hit = store.lookup(derivation.key) is not None
    path = store.build(derivation.name, derivation.inputs, build)
    return Resolved(path, hit, time.perf_counter() - started, {"source": "init"})


def _from_run(loaded: LoadedManifest, store: Store, echo=print) -> Resolved:
    """A run's policy at a checkpoint, exported into the store on first use (as `primebuild export`)."""
    from primebuild.builders.model_ref import export_source_located
    from primebuild.runtime.export import export_into_store, newest_verified_step

    m = loaded.manifest.model
    started = time.perf_counter()
    if m.step is None:  # the newest checkpoint that verifies, as `export` without --step
        step = newest_verified_step(loaded.resolve(m.from_run, ("model", "from_run")), warn=echo)  # type: ignore[arg-type]
        loaded = loaded if step is None else _with_step(loaded, step)
    source = export_source_located(loaded)
    path, hit = export_into_store(source, store)
    if not hit:
        echo(f"exported {source.run.root} step {source.step} into the store: {path}")
    return Resolved(path, hit, time.perf_counter() - started, {"source": "from_run", "run": str(source.run.root),
                                                               "step": source.step})


def _with_step(loaded: LoadedManifest, step: int) -> LoadedManifest:
    import dataclasses

    model = loaded.manifest.model.model_copy(update={"step": step})
    return dataclasses.replace(loaded, manifest=loaded.manifest.model_copy(update={"model": model}))


def _no_progress_bars() -> None:
    """Builds run inside `primebuild run`: its terminal shows progress lines, not transformers' bars."""
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as hf_logging

    disable_progress_bars()
    hf_logging.disable_progress_bar()


def _move_contents(src: Path, dst: Path) -> None:
    """The savers refuse an existing folder; the store hands the builder an empty one: move up."""
    for item in src.iterdir():
        item.rename(dst / item.name)
    src.rmdir()


def _store_ref(store: Store, path: Path) -> str:
    """A machine-independent name for an input: its store entry name, else the path itself."""
    try:
        return path.resolve().relative_to(store.root.resolve()).parts[0]
    except ValueError:
        return str(path)
