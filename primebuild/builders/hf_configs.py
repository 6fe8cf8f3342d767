"""A hub model's config files: fetched by `primebuild lock` into the store, read back by `plan`.

The planner sizes a model from its config.json (model_facts.py). A manifest that names `model.hf` and no
facts file (no `model.facts`, nothing at manifests/models/<name>.json) gets it from the hub: `lock`
downloads config.json and, where the repository has them, generation_config.json and tokenizer_config.json
at the commit it pins, with huggingface_hub (from the hub, or from its local cache offline), into a store
entry keyed by repository, commit and each file's sha256 (derivations.hf_configs), and records those
digests in the lock's model entry under `configs`. `plan` reads config.json from the entry the lock names
and checks it against the recorded digest: no network, no huggingface_hub import, a few KB read.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from primebuild.builders import derivations
from primebuild.builders.store import Store
from primebuild.errors import UserError
from primebuild.hashing import sha256_file
from primebuild.json_file import read_json
from primebuild.manifest.load import LoadedManifest

CONFIG = "config.json"
# config.json sizes the model; the other two are what its tokenizer and its sampling defaults are read from.
CONFIG_FILES = (CONFIG, "generation_config.json", "tokenizer_config.json")


class NotFetched(Exception):
    """A config file could not be had at the commit; the message is the lock entry's reason."""


# ---- lock: fetch into the store ---------------------------------------------------------------------------


def fetch(repo: str, commit: str, *, offline: bool, store: Store | None = None,
          names: tuple[str, ...] | None = None) -> dict:
    """The lock's `configs` ({store_key, files: {name: {sha256, size}}}) of `repo` at `commit`, with the files
    in the store (a cache hit when they are there already). `names`: exactly these files, each required
    (re-fetching what a lock names); None: config.json and whichever of the others the repository has."""
    downloaded = _download(repo, commit, offline, names)
    files = {name: {"sha256": sha256_file(path), "size": path.stat().st_size}
             for name, path in sorted(downloaded.items())}
    derivation = derivations.hf_configs(repo, commit, {name: row["sha256"] for name, row in files.items()})

    def copy(out: Path) -> None:
        for name, path in downloaded.items():
            shutil.copyfile(path, out / name)
            if sha256_file(out / name) != files[name]["sha256"]:  # the cache's blob changed under us
                raise NotFetched(f"{name} of {repo}@{commit} changed while it was copied into the store")

    (store or Store()).build(derivation.name, derivation.inputs, copy)
    return {"store_key": derivation.key, "files": files}


def restore(entry: dict, *, offline: bool, store: Store | None = None) -> str | None:
    """Put the configs a kept lock entry names back into this machine's store when they are missing (a lock
    made elsewhere, a store wiped); the reason when they cannot be fetched, None when they are there."""
    store = store or Store()
    configs = entry["configs"]
    if store.lookup(configs["store_key"]) is not None:
        return None
    repo = entry["request"]["repo"]
    try:
        fetched = fetch(repo, entry["commit"], offline=offline, store=store, names=tuple(configs["files"]))
    except NotFetched as err:
        return str(err)
    if fetched != configs:  # a commit's files never change: the lock or the cache was edited by hand
        raise UserError(f"{repo}@{entry['commit']}: the config files fetched now differ from the lock's digests",
                        hint="re-pin with `primebuild lock --update MANIFEST`")
    return None


def _download(repo: str, commit: str, offline: bool, names: tuple[str, ...] | None) -> dict[str, Path]:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    found: dict[str, Path] = {}
    for name in names or CONFIG_FILES:
        required = names is not None or name == CONFIG
        where = f"{name} of {repo}@{commit}"
        try:
            found[name] = Path(hf_hub_download(repo, name, revision=commit, local_files_only=offline))
        # Local first: it subclasses EntryNotFoundError. The cache may hold only part of a repository, so
        # an optional file missing from it is left out rather than guessed.
        except LocalEntryNotFoundError:
            if required:
                raise NotFetched(f"{where} is not in the local Hugging Face cache and the hub was "
                                 f"{'not asked (offline)' if offline else 'not reachable'}") from None
        except EntryNotFoundError:  # the repository has no such file at this commit
            if required:
                raise NotFetched(f"{repo}@{commit} has no {name}") from None
        except (OSError, ValueError) as err:  # refused by the hub (gated, unknown repo), or a broken transfer
            first = str(err).strip().splitlines()[0][:160] if str(err).strip() else ""
            raise NotFetched(f"{where} could not be fetched ({type(err).__name__}: {first})") from None
    return found


# ---- plan: read back, pure ----------------------------------------------------------------------------------


def locked_config(loaded: LoadedManifest, lock: dict | None, shown: str) -> tuple[dict, str]:
    """(config.json, its path for messages) of `loaded`'s hub model, from the store entry its lock names.
    `lock` None: the manifest's own lock file when there is one. `shown`: the facts file that was looked for.
    Every way it is missing is a located UserError that names the command fetching it."""
    from primebuild.builders.lock import lock_path_for, model_request, read_lock  # lock imports model_ref

    model = loaded.manifest.model
    lock_file = str(lock_path_for(loaded))
    fetch_it = (f"`primebuild lock {loaded.path}` fetches the model's config.json into the store (from the hub, "
                "or offline from the Hugging Face cache)")

    def missing(message: str, hint: str = fetch_it) -> UserError:
        return UserError(loaded.source.problem(("model", "hf"), message, hint=hint))

    if lock is None:
        if not Path(lock_file).is_file():
            raise missing(f"architecture facts of {model.hf} not found: no {shown}, and no lock ({lock_file}) "
                          "names its fetched config.json",
                          hint=f"{fetch_it}; or add the config as {shown}, or set model.facts")
        lock = read_lock(Path(lock_file))
    entry = lock.get("model") if isinstance(lock.get("model"), dict) else {}
    if entry.get("request") != model_request(loaded):
        asked = entry.get("request") or {}
        raise missing(f"the lock pins {asked.get('repo')}@{asked.get('revision')}, not {model.hf}@{model.revision}")
    configs = entry.get("configs")
    if not isinstance(configs, dict):
        raise missing(f"{model.hf}'s config.json was not fetched when the lock was made "
                      f"({entry.get('reason', 'the lock predates fetched configs')})")
    store, key = Store(), str(configs.get("store_key"))
    try:
        path = store.path_of(key) / CONFIG
    except ValueError:
        raise missing(f"the lock's model.configs.store_key {key!r} is not a store key") from None
    if not path.is_file():
        raise missing(f"{model.hf}'s config.json is not in this machine's store: the lock names the entry "
                      f"{key}, which {store.root} does not hold")
    if sha256_file(path) != (configs.get("files") or {}).get(CONFIG, {}).get("sha256"):
        raise missing(f"{path} does not match the sha256 the lock recorded for it",
                      hint=f"`primebuild store gc --broken` removes the modified entry, then {fetch_it}")
    return read_json(path, what="config", want_object=True), str(path)
