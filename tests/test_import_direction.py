"""Wrong-way imports stay out: the orchestrator and the trainer meet only in what sits beside them
(contracts, primebuild/runtime/rollout_file.py, primebuild/runtime/metrics.py), never in each other's modules."""

import ast
from pathlib import Path

import pytest

RUNTIME = Path(__file__).resolve().parent.parent / "primebuild" / "runtime"


def imported_modules(path: Path, package: str) -> set[str]:
    """Absolute names of every module `path` imports (relative imports resolved against `package`)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


@pytest.mark.parametrize("side, other", [("orchestrator", "trainer"), ("trainer", "orchestrator")])
def test_orchestrator_and_trainer_do_not_import_each_other(side, other):
    forbidden = f"primebuild.runtime.{other}"
    for path in sorted((RUNTIME / side).rglob("*.py")):
        package = "primebuild.runtime." + ".".join(path.relative_to(RUNTIME).parent.parts)
        wrong = [m for m in imported_modules(path, package) if m == forbidden or m.startswith(forbidden + ".")]
        assert not wrong, f"{path.relative_to(RUNTIME)} imports {wrong}"


def test_relative_imports_resolve():
    # The check above is only as good as the resolution of `from ..x import y`: pin it on a known file.
    names = imported_modules(RUNTIME / "trainer" / "main.py", "primebuild.runtime.trainer")
    assert "primebuild.runtime.rollout_file" in names and "primebuild.runtime.trainer.batch" in names


def test_the_orchestrator_never_loads_torch():
    """The orchestrator's process holds rollouts, not tensors: numpy and safetensors' numpy API write its
    batches, so the embedded default's tree does not pay torch's ~220 MiB a third time
    (bench/process_memory.py)."""
    import json
    import subprocess
    import sys

    script = """
import json, sys
import primebuild.runtime.orchestrator.main
import primebuild.runtime.envs.registry as registry
from primebuild.runtime.rollout_file import save_batch, load_batch
from primebuild.runtime.weight_sync.filesystem import verify, latest_stable
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == []
