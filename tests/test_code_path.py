"""A process in another Python environment (vLLM's) gets this checkout's primebuild through PYTHONPATH
(primebuild/code_path.py), from the worker that starts it; the checkout's root may go on that path because
`primebuild` is the only package there."""

from __future__ import annotations

import os
from pathlib import Path

from conftest import MANIFESTS, REPO

from primebuild import code_path
from primebuild.builders.plan import compile_plan
from primebuild.contracts.plan import render_json
from primebuild.contracts.run_dir import Rendezvous, RunDir
from primebuild.manifest.load import load_manifest
from primebuild.runtime import worker


def test_the_checkout_root_holds_no_importable_package_but_primebuild():
    """What lies at the root is put on vLLM's path: a module or package there would shadow vLLM's own."""
    importable = sorted(p.name for p in REPO.iterdir() if p.stem.isidentifier() and (
        (p.is_dir() and (p / "__init__.py").is_file()) or (p.is_file() and p.suffix in (".py", ".so", ".pyc"))))
    assert importable == ["primebuild"]
    assert code_path.checkout_root() == REPO


def test_the_worker_hands_its_checkout_to_the_processes_of_another_environment(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/elsewhere/site", str(REPO)]))
    plan = compile_plan(load_manifest(MANIFESTS / "reverse-text.yaml", ["inference.engine=vllm"]))
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    run.plan.write_text(render_json(plan))
    run.rendezvous.write_text(Rendezvous(hosts=["127.0.0.1"], model_path="/models/tiny",
                                         environments={"vllm": "/envs/vllm/bin/python"}).model_dump_json())
    argv, env = worker.prepare(worker.read_plan(run.plan), "inference-0", run)
    assert argv[0] == "/envs/vllm/bin/python"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/elsewhere/site"]  # first, once
    _, trainer = worker.prepare(worker.read_plan(run.plan), "trainer", run)
    assert trainer["PYTHONPATH"] == os.pathsep.join(["/elsewhere/site", str(REPO)])  # its own env: as inherited


def test_an_installed_primebuild_hands_nothing_over(tmp_path: Path, monkeypatch):
    """A wheel lies in site-packages beside torch and our other pins: that folder never reaches vLLM."""
    site = tmp_path / "site-packages"
    (site / "primebuild").mkdir(parents=True)
    monkeypatch.setattr(code_path, "PACKAGE", site / "primebuild")
    assert code_path.checkout_root() is None
    assert code_path.with_checkout({"PYTHONPATH": "/x"}) == {"PYTHONPATH": "/x"}
    assert "PYTHONPATH" not in code_path.with_checkout({})
