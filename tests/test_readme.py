"""README stays true: every command it shows in a code block runs here as written, and its links resolve.

Commands are read from README's ```bash and ```console blocks (`$ ` lines in a console block, with the
output shown under them). Each is run through bash in a folder that looks like the checkout, with the
project's interpreter first on PATH. Two kinds are not run verbatim, and say why: `primebuild run` gets
a few `--set`s that shrink it to a few steps (the full main job is measured by hand; its numbers are in
README with the date), and `scripts/bootstrap` is what `.ci/run` itself runs before pytest.
A command no rule below knows fails `test_every_command_has_a_rule`: a new README command needs its test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, free_port, sft_workspace

README = REPO / "README.md"
MAX_LINES = 250
SHRINK_RUN = ["orchestrator.max_steps=3", "orchestrator.rollouts_per_step=32", "orchestrator.eval_prompts=40",
              "orchestrator.eval_every=3"]
WATCH = ("primebuild status", "primebuild logs", "primebuild verify")  # need the run folder `run` wrote


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M)


def commands(text: str) -> list[tuple[str, list[str]]]:
    """(command, the output lines shown under it) in README order; `.venv/bin/` dropped (README says to
    activate the venv), trailing `# comments` dropped, `\\` continuations joined."""
    found = []
    for lang, body in code_blocks(text):
        if lang == "console":
            for chunk in re.split(r"^\$ ", body, flags=re.M)[1:]:
                first, *shown = chunk.rstrip("\n").split("\n")
                found.append((first, shown))
        elif lang == "bash":
            for line in body.replace("\\\n", " ").splitlines():
                line = re.sub(r"\s+#.*$", "", line).strip()
                if line and not line.startswith("#"):
                    found.append((line, []))
    return [(cmd.replace(".venv/bin/", "").strip(), shown) for cmd, shown in found]


def rule(cmd: str) -> str:
    if cmd.startswith("scripts/bootstrap"):
        return "ci"
    if cmd.startswith("primebuild run "):
        return "run"
    if cmd.startswith(WATCH):
        return "watch"
    if cmd.startswith(("primebuild validate ", "primebuild plan ", "primebuild render ")):
        return "pure"
    return "unknown"


def shell(cmd: str, cwd: Path, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    return subprocess.run(["bash", "-c", cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PATH": path, "COLUMNS": "300", **(env or {})})


README_COMMANDS = commands(README.read_text())


def test_readme_is_short_and_its_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_LINES, f"README.md is {len(text.splitlines())} lines (at most {MAX_LINES})"
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not target.startswith(("http://", "https://")):
            assert (REPO / target).exists(), f"README links to {target}, which does not exist"


def test_every_command_has_a_rule():
    assert README_COMMANDS, "no command found in README's code blocks"
    unknown = [cmd for cmd, _ in README_COMMANDS if rule(cmd) == "unknown"]
    assert not unknown, f"README commands no test runs (add a rule in {Path(__file__).name}): {unknown}"


def test_ci_runs_the_readme_test_command():
    bootstraps = [cmd for cmd, _ in README_COMMANDS if rule(cmd) == "ci"]
    assert "scripts/bootstrap --test && pytest -n 3" in bootstraps, bootstraps
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"^scripts/bootstrap --test\b", ci, flags=re.M) and re.search(r"^\.venv/bin/pytest\b", ci, flags=re.M)


@pytest.fixture(scope="module")
def checkout_view(tmp_path_factory) -> Path:
    """A folder whose `manifests/` and `docs/` are the checkout's, so output files land outside it."""
    root = tmp_path_factory.mktemp("readme")
    for name in ("manifests", "docs"):
        (root / name).symlink_to(REPO / name)
    return root


def numbers(line: str) -> list[str]:
    return re.findall(r"\d[\d,]*(?:\.\d+)?\s?(?:GiB|s|x)\b", line)


@pytest.mark.parametrize("cmd,shown", [c for c in README_COMMANDS if rule(c[0]) == "pure"], ids=lambda v: str(v)[:60])
def test_pure_command(cmd, shown, checkout_view):
    result = shell(cmd, checkout_view)
    out = result.stdout + result.stderr
    if shown and shown[0].startswith("error:"):
        assert result.returncode == 2, out
    else:
        assert result.returncode == 0, out
    if any("…" in line for line in shown):  # abridged: every figure it shows is one printed today
        for line in shown:
            for number in numbers(line):
                assert number in out, f"README shows {number!r} ({line.strip()}); `{cmd}` prints no such figure"
    elif shown:  # shown in full: printed exactly
        assert out.strip().splitlines() == shown, out


@pytest.fixture(scope="module")
def run_folder_parent(tmp_path_factory, short_sft_store) -> Path:
    root = tmp_path_factory.mktemp("readme-run")
    sft_workspace(root, ("reverse-text.yaml",), seed_store=short_sft_store)
    return root


@pytest.mark.timeout(600)
def test_run_then_watch(run_folder_parent):
    """README's `run`, shrunk to 3 steps, then its status/logs/verify commands on the folder it wrote."""
    env = {"PRIMEBUILD_STORE": str(run_folder_parent / "store")}
    runs = [cmd for cmd, _ in README_COMMANDS if rule(cmd) == "run"]
    assert runs
    for cmd in runs:
        sets = " ".join(f"--set {s}" for s in [*SHRINK_RUN, f"inference.port={free_port()}"])
        result = shell(f"{cmd} {sets}", run_folder_parent, env, timeout=540)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for cmd in [cmd for cmd, _ in README_COMMANDS if rule(cmd) == "watch"]:
        result = shell(cmd, run_folder_parent, env)
        assert result.returncode == 0, f"{cmd}: {result.stdout}{result.stderr}"
        assert result.stdout.strip(), f"{cmd} printed nothing"
