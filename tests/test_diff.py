"""`primebuild diff`: field-by-field differences, exit codes like diff(1)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import CPU_MANIFEST, call_cli, write

from primebuild.builders.diff import diff_values


def test_diff_values_paths_and_named_lists():
    old = {"a": {"b": 1, "gone": True}, "procs": [{"name": "x", "argv": ["p", "1"]}, {"name": "y", "port": 1}],
           "tags": [1, 2]}
    new = {"a": {"b": 2, "new": None}, "procs": [{"name": "y", "port": 1}, {"name": "x", "argv": ["p", "2"]}],
           "tags": [1, 2, 3]}
    rendered = {c.path: (c.kind, c.to_json().get("old"), c.to_json().get("new")) for c in diff_values(old, new)}
    assert rendered == {
        "a.b": ("changed", 1, 2),
        "a.gone": ("removed", True, None),
        "a.new": ("added", None, None),
        "procs[x].argv": ("changed", ["p", "1"], ["p", "2"]),
        "tags": ("changed", [1, 2], [1, 2, 3]),
    }
    assert diff_values({"x": [1, {"k": 1}]}, {"x": [1, {"k": 1}]}) == []
    assert [c.path for c in diff_values({"x": 1}, {"x": 1.5})] == ["x"]


def test_diff_two_manifests(workdir: Path, capsys):
    a = write(workdir, "a.yaml", CPU_MANIFEST)
    b = write(workdir, "b.yaml", CPU_MANIFEST.replace("group_size: 8", "group_size: 4") + "seed: 3\n")
    same = call_cli(capsys, "diff", a, a)
    assert same.code == 0 and "no differences" in same.out
    result = call_cli(capsys, "diff", a, b)
    assert result.code == 1
    assert "~ orchestrator.group_size: 8 -> 4" in result.out
    assert "~ seed: 0 -> 3" in result.out
    as_json = call_cli(capsys, "diff", "-o", "json", a, b)
    assert as_json.code == 1
    changes = json.loads(as_json.out)["changes"]["manifest"]
    assert {"path": "seed", "kind": "changed", "old": 0, "new": 3} in changes


def test_diff_two_plans(workdir: Path, capsys):
    manifest = write(workdir, "m.yaml", CPU_MANIFEST)
    plans = []
    for extra in ([], ["--set", "trainer.optimizer.lr=0.001"]):
        result = call_cli(capsys, "plan", "-o", "json", manifest, *extra)
        assert result.code == 0, result.text
        plans.append(write(workdir, f"plan{len(plans)}.json", result.out))
    result = call_cli(capsys, "diff", *plans)
    assert result.code == 1
    assert "processes[trainer].config.lr" in result.out and "-> 0.001" in result.out
    assert "~ manifest_hash:" in result.out


def test_diff_bad_input_exits_2(workdir: Path, capsys):
    manifest = write(workdir, "m.yaml", CPU_MANIFEST)
    plan = write(workdir, "p.json", call_cli(capsys, "plan", "-o", "json", manifest).out)
    junk = write(workdir, "j.json", '{"hello": 1}')
    assert call_cli(capsys, "diff", manifest, plan).code == 2  # nothing in common
    assert call_cli(capsys, "diff", junk, plan).code == 2
    assert call_cli(capsys, "diff", workdir / "missing.json", plan).code == 2
    assert call_cli(capsys, "diff", workdir, plan).code == 2  # a folder without plan.json
