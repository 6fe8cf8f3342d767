"""A hub model without a facts file plans: `lock` fetches its config files at the pinned commit into the
store (primebuild/builders/hf_configs.py), `plan` reads the facts from there. Offline, with HF_HUB_OFFLINE=1,
against a Hugging Face cache built here in the layout huggingface_hub writes and reads."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import MANIFESTS, REPO, call_cli, run_cli, write

from primebuild.builders import lock as lockmod
from primebuild.builders.store import Store

HUB_REPO = "Qwen/Qwen3-30B-A3B"
COMMIT = "ad44e777bcd18fa416d9da3bd8f70d33ebb85d39"
CONFIG = (MANIFESTS / "models" / "qwen3-30b-a3b.json").read_bytes()  # the published config.json, plus a note
TOKENIZER_CONFIG = b'{"model_max_length": 131072, "tokenizer_class": "Qwen2Tokenizer"}\n'


def hf_cache(root: Path, files: dict[str, bytes]) -> None:
    """`files` of HUB_REPO at COMMIT as huggingface_hub caches them: refs/main names the commit, blobs/ holds
    the bytes under their git hash, snapshots/<commit>/ links each file name to its blob."""
    repo = root / "hub" / f"models--{HUB_REPO.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, data in files.items():
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        (snapshot / name).symlink_to(f"../../blobs/{blob}")


@pytest.fixture
def project(tmp_path: Path, monkeypatch) -> Path:
    """tmp/manifests/qwen3.yaml: the shipped Qwen3-30B-A3B manifest without its facts file, beside the
    committed lock of the original, whose pinned Python and base-image entries it reuses (no PyPI, no
    Debian archive). The store and the Hugging Face cache are the test's own."""
    text = (MANIFESTS / "qwen3-30b-a3b.yaml").read_text().replace("  facts: models/qwen3-30b-a3b.json\n", "")
    assert "facts:" not in text
    (tmp_path / "manifests").mkdir()
    manifest = write(tmp_path / "manifests", "qwen3.yaml", text)
    (tmp_path / "lockfiles").mkdir()
    shutil.copy(REPO / "lockfiles" / "qwen3-30b-a3b.lock", tmp_path / "lockfiles" / "committed-qwen3-30b-a3b.lock")
    monkeypatch.setenv("PRIMEBUILD_STORE", str(tmp_path / "store"))
    return manifest


def offline_env(tmp_path: Path) -> dict[str, str]:
    return {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"), "HF_HUB_OFFLINE": "1",
            "PRIMEBUILD_STORE": str(tmp_path / "store")}


def test_lock_fetches_the_configs_into_the_store_and_plan_reads_the_facts_there(project: Path, tmp_path: Path,
                                                                                capsys):
    env = offline_env(tmp_path)
    # no lock yet: a located error that says which command fetches the config
    before = call_cli(capsys, "plan", "--design", project)
    assert before.code == 2 and "Traceback" not in before.err
    assert f"{project}:9:" in before.err and "architecture facts of Qwen/Qwen3-30B-A3B not found" in before.err
    assert f"primebuild lock {project}" in before.err

    # no network and nothing cached: the lock records why; plan still says which command fetches it
    empty = run_cli("lock", project, env=env, timeout=120)
    assert empty.code == 0, empty.text
    assert "not pinned: model" in empty.err and "not in the local cache" in empty.err
    unfetched = call_cli(capsys, "plan", "--design", project)
    assert unfetched.code == 2 and "Traceback" not in unfetched.err
    assert "config.json was not fetched when the lock was made" in unfetched.err
    assert f"primebuild lock {project}" in unfetched.err and f"{project}:9:" in unfetched.err

    # the model in the cache (without a generation_config.json): pinned, fetched, digests in the lock
    hf_cache(tmp_path / "hf", {"config.json": CONFIG, "tokenizer_config.json": TOKENIZER_CONFIG})
    cached = run_cli("lock", project, env=env, timeout=120)
    assert cached.code == 0, cached.text
    lock = lockmod.read_lock(tmp_path / "lockfiles" / "qwen3.lock")
    model = lock["model"]
    assert model["pinned"] and model["commit"] == COMMIT
    assert model["configs"]["files"] == {
        "config.json": {"sha256": hashlib.sha256(CONFIG).hexdigest(), "size": len(CONFIG)},
        "tokenizer_config.json": {"sha256": hashlib.sha256(TOKENIZER_CONFIG).hexdigest(),
                                  "size": len(TOKENIZER_CONFIG)}}
    key = model["configs"]["store_key"]
    assert key.endswith("-Qwen--Qwen3-30B-A3B-configs")
    entry = Store(tmp_path / "store").verify(key)
    assert (entry.path / "config.json").read_bytes() == CONFIG and not (entry.path / "generation_config.json").exists()

    planned = call_cli(capsys, "plan", "--design", "-o", "json", project)
    assert planned.code == 0, planned.err
    shipped = call_cli(capsys, "plan", "--design", "-o", "json", MANIFESTS / "qwen3-30b-a3b.yaml")
    ours, theirs = json.loads(planned.out)["model"], json.loads(shipped.out)["model"]
    assert (ours["total_params"], ours["active_params"], ours["architecture"]) == \
        (theirs["total_params"], theirs["active_params"], theirs["architecture"])
    assert json.loads(planned.out)["memory"] == json.loads(shipped.out)["memory"]

    # plan stays pure: neither torch nor huggingface_hub is imported on the way
    probe = subprocess.run([sys.executable, "-c", "import sys; from primebuild.cli import main; "
                            f"rc = main(['plan', '--design', {str(project)!r}]); "
                            "print(rc, 'torch' in sys.modules, 'huggingface_hub' in sys.modules)"],
                           capture_output=True, text=True, timeout=60, cwd=REPO,
                           env={**os.environ, **offline_env(tmp_path)})
    assert probe.stdout.strip().splitlines()[-1] == "0 False False", probe.stderr


def test_a_lock_from_elsewhere_fetches_its_configs_again_and_a_changed_one_is_refused(project: Path,
                                                                                      tmp_path: Path, capsys):
    env = offline_env(tmp_path)
    hf_cache(tmp_path / "hf", {"config.json": CONFIG})
    assert run_cli("lock", project, env=env, timeout=120).code == 0
    store = tmp_path / "store"
    subprocess.run(["chmod", "-R", "u+w", str(store)], check=True)
    shutil.rmtree(store)  # a fresh machine with a committed lock: the store does not hold the entry
    lock_path = tmp_path / "lockfiles" / "qwen3.lock"
    key = lockmod.read_lock(lock_path)["model"]["configs"]["store_key"]
    missing = call_cli(capsys, "plan", "--design", project)
    assert missing.code == 2 and f"{key}, which {store} does not hold" in missing.err
    assert f"primebuild lock {project}" in missing.err

    before = lock_path.read_bytes()
    again = run_cli("lock", "--offline", project, env=env, timeout=120)
    assert again.code == 0 and "is up to date" in again.out, again.text
    assert lock_path.read_bytes() == before and (store / key / "config.json").read_bytes() == CONFIG
    assert call_cli(capsys, "plan", "--design", project).code == 0

    lock = json.loads(before)
    lock["model"]["configs"]["files"]["config.json"]["sha256"] = "0" * 64
    lock_path.write_text(lockmod.render_lock(lock))
    edited = call_cli(capsys, "plan", "--design", project)
    assert edited.code == 2 and "does not match the sha256 the lock recorded" in edited.err
    assert "Traceback" not in edited.err
