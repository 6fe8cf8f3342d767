"""Composition: `extends:` deep merge (mappings merge, lists replace, parents in order) and `--set`
overrides typed by the schema; errors still point at the file and line a value came from."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import CPU_MANIFEST, call_cli, run_cli, write

from primebuild.errors import UserError
from primebuild.manifest.load import load_manifest

PARENT = CPU_MANIFEST + """\
secrets: [HF_TOKEN, WANDB_API_KEY]
"""


def test_extends_merges_mappings_and_replaces_lists(workdir: Path):
    write(workdir, "base.yaml", PARENT.replace("  ranks: 1\n", "  ranks: 1\n  optimizer: {betas: [0.9, 0.95], weight_decay: 0.1}\n"))
    write(workdir, "child.yaml", """\
extends: base.yaml
name: child
trainer:
  checkpoint_every: 7
  optimizer: {betas: [0.8, 0.9]}
environments:
  - {id: other-env}
secrets: [HF_TOKEN]
""")
    loaded = load_manifest(workdir / "child.yaml")
    m = loaded.manifest
    assert m.name == "child"
    # mappings merge key by key, at every depth
    assert m.trainer.checkpoint_every == 7 and m.trainer.ranks == 1 and m.trainer.micro_batch_tokens == 4096
    assert m.trainer.optimizer.weight_decay == 0.1 and m.trainer.optimizer.betas == (0.8, 0.9)
    assert m.hardware.gpu == "cpu" and m.orchestrator.seq_len == 64
    # lists are replaced, never concatenated
    assert [e.id for e in m.environments] == ["other-env"]
    assert m.secrets == ["HF_TOKEN"]
    assert "extends" not in loaded.document
    assert [p.name for p in loaded.files] == ["base.yaml", "child.yaml"]


def test_multiple_parents_merge_in_order_then_the_child(workdir: Path):
    write(workdir, "base.yaml", PARENT)
    write(workdir, "big.yaml", "orchestrator: {seq_len: 128, max_completion_tokens: 32}\nseed: 1\n")
    write(workdir, "bigger.yaml", "orchestrator: {seq_len: 256}\nseed: 2\ndescription: from bigger\n")
    write(workdir, "child.yaml", "extends: [base.yaml, big.yaml, bigger.yaml]\nseed: 3\n")
    m = load_manifest(workdir / "child.yaml").manifest
    assert m.orchestrator.seq_len == 256  # the later parent wins
    assert m.orchestrator.max_completion_tokens == 32  # ... key by key
    assert m.description == "from bigger"
    assert m.seed == 3  # the child wins over every parent
    write(workdir, "child.yaml", "extends: [base.yaml, bigger.yaml, big.yaml]\n")
    m = load_manifest(workdir / "child.yaml").manifest
    assert m.orchestrator.seq_len == 128 and m.seed == 1 and m.description == "from bigger"


def test_extends_chain_and_paths_relative_to_the_naming_file(workdir: Path):
    (workdir / "common").mkdir()
    (workdir / "exp").mkdir()
    write(workdir, "common/cpu.yaml", PARENT.replace("models/", "../models/"))
    write(workdir, "common/tiny.yaml", "extends: cpu.yaml\nseed: 11\n")
    write(workdir, "exp/run.yaml", "extends: ../common/tiny.yaml\nname: run\n")
    loaded = load_manifest(workdir / "exp" / "run.yaml")
    assert loaded.manifest.seed == 11 and loaded.manifest.name == "run"
    assert [p.name for p in loaded.files] == ["cpu.yaml", "tiny.yaml", "run.yaml"]


def test_error_points_at_the_parent_file_the_value_came_from(workdir: Path):
    bad_parent = PARENT.replace("  micro_batch_tokens: 4096", "  micro_batch_tokens: 4096\n  checkpoint_every: -5")
    write(workdir, "base.yaml", bad_parent)
    write(workdir, "child.yaml", "extends: base.yaml\nname: child\ntrainer: {precision: fp64}\n")
    with pytest.raises(UserError) as err:
        load_manifest(workdir / "child.yaml")
    text = str(err.value)
    line = bad_parent.splitlines().index("  checkpoint_every: -5") + 1
    base_shown = str(workdir / "base.yaml")
    assert f"{base_shown}:{line}:3: trainer.checkpoint_every: Input should be greater than or equal to 1" in text
    assert f"{workdir / 'child.yaml'}:3:11: trainer.precision: got 'fp64'" in text


def test_child_override_is_located_in_the_child(workdir: Path):
    write(workdir, "base.yaml", PARENT)
    write(workdir, "child.yaml", "extends: base.yaml\nhardware:\n  cpus_per_node: 0\n")
    with pytest.raises(UserError) as err:
        load_manifest(workdir / "child.yaml")
    assert f"{workdir / 'child.yaml'}:3:3: hardware.cpus_per_node:" in str(err.value)


def test_extends_cycle_is_located_at_the_looping_entry(workdir: Path):
    write(workdir, "a.yaml", "apiVersion: primebuild/v1\nextends: [b.yaml]\n")
    write(workdir, "b.yaml", "name: x\nextends:\n  - a.yaml\n")
    result = run_cli("validate", "a.yaml", cwd=workdir)
    assert result.code == 2 and "Traceback" not in result.text
    assert "error: b.yaml:3:5: extends[0]: `extends:` cycle:" in result.err
    assert result.err.index("a.yaml") < result.err.index("b.yaml ->")
    write(workdir, "self.yaml", "extends: self.yaml\n")
    with pytest.raises(UserError, match=r"self\.yaml:1:1: extends: `extends:` cycle"):
        load_manifest(workdir / "self.yaml")


def test_extends_missing_file_and_bad_shape(workdir: Path, capsys, monkeypatch):
    write(workdir, "m.yaml", "apiVersion: primebuild/v1\nextends:\n  - nope.yaml\n")
    result = run_cli("plan", "m.yaml", cwd=workdir)
    assert result.code == 2 and "Traceback" not in result.text
    assert "m.yaml:3:5: extends[0]: extended file not found: nope.yaml" in result.err
    assert "relative to the manifest" in result.err
    monkeypatch.chdir(workdir)
    write(workdir, "m.yaml", "apiVersion: primebuild/v1\nextends: {a: b}\n")
    result = call_cli(capsys, "validate", "m.yaml")
    assert result.code == 2 and "m.yaml:2:1: extends: `extends:` must be a file name or a list" in result.err


def test_problems_in_a_parent_file_are_reported(workdir: Path):
    write(workdir, "base.yaml", PARENT.replace("name: tiny", "name: tiny\nname: again"))
    write(workdir, "child.yaml", "extends: base.yaml\n")
    with pytest.raises(UserError, match=r"base\.yaml:3:1: name: duplicate key 'name'"):
        load_manifest(workdir / "child.yaml")


# --- --set -------------------------------------------------------------------------------------------------


def test_set_is_typed_by_the_schema(workdir: Path):
    path = write(workdir, "m.yaml", CPU_MANIFEST)
    loaded = load_manifest(path, ["trainer.dp_shard=16", "inference.router_replay=false", "trainer.optimizer.lr=3e-4",
                                  "image.python=3.12", "description=123", "model.revision=2024-01-01",
                                  "secrets=[A, B_2]", "trainer.nodes=null", "trainer.ranks=16"])
    m = loaded.manifest
    assert m.trainer.dp_shard == 16 and type(m.trainer.dp_shard) is int
    assert m.inference.router_replay is False
    assert m.trainer.optimizer.lr == 3e-4
    assert m.image.python == "3.12"  # text fields stay text, even when the value reads as a number
    assert m.description == "123" and m.model.revision == "2024-01-01"
    assert m.secrets == ["A", "B_2"] and m.trainer.nodes is None
    assert loaded.document["trainer"]["dp_shard"] == 16


def test_set_overrides_extends_and_creates_sections(workdir: Path):
    write(workdir, "base.yaml", PARENT)
    write(workdir, "child.yaml", "extends: base.yaml\nseed: 3\n")
    m = load_manifest(workdir / "child.yaml", ["seed=9", "weight_sync.mode=broadcast", "sft.steps=5"]).manifest
    assert m.seed == 9 and m.weight_sync.mode == "broadcast" and m.sft is not None and m.sft.steps == 5


def test_set_changes_the_manifest_hash_and_plan(workdir: Path, capsys, monkeypatch):
    write(workdir, "m.yaml", CPU_MANIFEST)
    monkeypatch.chdir(workdir)
    plain = call_cli(capsys, "validate", "m.yaml", "-o", "json")
    same = call_cli(capsys, "validate", "m.yaml", "-o", "json", "--set", "seed=0")
    other = call_cli(capsys, "validate", "m.yaml", "-o", "json", "--set", "seed=1")
    assert plain.code == same.code == other.code == 0
    assert plain.out == same.out != other.out  # defaults count as written: seed 0 is the default


def test_set_value_error_is_located_at_the_set(workdir: Path):
    path = write(workdir, "m.yaml", CPU_MANIFEST)
    with pytest.raises(UserError) as err:
        load_manifest(path, ["orchestrator.temperature=99"])
    assert str(err.value).startswith("--set: orchestrator.temperature: Input should be less than or equal to 10")


def test_set_through_the_real_cli(workdir: Path):
    write(workdir, "m.yaml", CPU_MANIFEST)
    result = run_cli("plan", "m.yaml", "-o", "json", "--compact", "--set", "trainer.ranks=2", "--set", "trainer.dp_shard=2",
                     cwd=workdir)
    assert result.code == 0, result.err
    assert '"--nproc-per-node","2"' in result.out


def test_a_path_in_an_extended_file_is_relative_to_that_file(workdir: Path):
    # a parent in another folder names its model relative to itself, as its own `extends:` would
    (workdir / "family").mkdir()
    write(workdir, "family/base.yaml", CPU_MANIFEST.replace("init: random", "from_manifest: sft.yaml"))
    write(workdir, "child.yaml", "extends: family/base.yaml\nname: child\n")
    loaded = load_manifest(workdir / "child.yaml")
    assert loaded.resolve("sft.yaml", ("model", "from_manifest")) == (workdir / "family" / "sft.yaml").resolve()
    # the child's own paths, and --set ones, stay relative to the child
    write(workdir, "own.yaml", "extends: family/base.yaml\nname: own\nmodel: {from_manifest: sft.yaml}\n")
    assert load_manifest(workdir / "own.yaml").resolve("sft.yaml", ("model", "from_manifest")) == \
        (workdir / "sft.yaml").resolve()
    overridden = load_manifest(workdir / "child.yaml", ["model.from_manifest=other.yaml"])
    assert overridden.resolve("other.yaml", ("model", "from_manifest")) == (workdir / "other.yaml").resolve()
