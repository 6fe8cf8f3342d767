"""The vLLM argv our GPU plans write (design studies today) is one vLLM 0.32 accepts: every inference process of the shipped
GPU manifests, parsed by vLLM's own `serve` parser and `AsyncEngineArgs.from_cli_args` inside the vLLM
environment (tests/vllm_parse_argv.py), with no unknown argument and no validation error."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
from conftest import REPO, run_cli
from vllm_helpers import vllm_python

from primebuild.builders.vllm_command import MODULE

pytestmark = pytest.mark.vllm

GPU_MANIFESTS = ["glm5.yaml", "qwen3-30b-a3b.yaml"]
# manifest values no shipped manifest holds, each mapped to vLLM's own spelling (bf16 is its "bfloat16")
VARIANTS = {"qwen3-30b-a3b.yaml+kv-bf16": ("qwen3-30b-a3b.yaml", "inference.kv_cache_dtype=bf16")}


def vllm_argvs(manifest: str, *sets: str, label: str | None = None) -> dict[str, list[str]]:
    result = run_cli("plan", REPO / "manifests" / manifest, "--design", "-o", "json",
                     *(a for s in sets for a in ("--set", s)), timeout=120)
    assert result.code == 0, result.text
    out = {}
    for process in json.loads(result.out)["processes"]:
        argv = process["argv"]
        if argv[1:3] != ["-m", MODULE]:
            continue
        # `python -m vllm.entrypoints.openai.api_server ARGS` takes exactly the arguments of `vllm serve ARGS`
        argv = ["vllm", "serve", *argv[3:]]
        # fill the placeholders `primebuild worker` fills at start
        filled = [re.sub(r"\{(host|bind):[^}]*\}", "127.0.0.1", a.replace("{model_path}", "/models/dummy")) for a in argv]
        assert not any("{" in a and "}" in a and not a.startswith("{\"") for a in filled), filled
        out[f"{label or manifest}:{process['name']}"] = filled
    assert out, f"{manifest} plans no vLLM process"
    return out


@pytest.fixture(scope="module")
def vllm_output() -> dict:
    argvs = {}
    for manifest in GPU_MANIFESTS:
        argvs.update(vllm_argvs(manifest))
    for label, (manifest, *sets) in VARIANTS.items():
        argvs.update(vllm_argvs(manifest, *sets, label=label))
    python = vllm_python()
    proc = subprocess.run([str(python), str(REPO / "tests" / "vllm_parse_argv.py")], input=json.dumps(argvs),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def parsed(vllm_output) -> dict[str, str | None]:
    return vllm_output["argv"]


@pytest.mark.parametrize("manifest", GPU_MANIFESTS + list(VARIANTS))
def test_vllm_accepts_every_inference_argv(parsed, manifest):
    errors = {name: err for name, err in parsed.items() if name.startswith(manifest + ":") and err}
    assert not errors, "vLLM 0.32 refuses these argv:\n" + "\n".join(f"{k}: {v}" for k, v in errors.items())



def test_the_plans_vllm_fp8_is_the_block_format_of_kernels_fp8(vllm_output):
    """`inference.precision: fp8` on a bf16 checkpoint (glm5.yaml) asks vLLM for `fp8_per_block`: 128x128
    e4m3 weight blocks (linear layers and routed experts) with fp32 scales, activations in dynamic 1x128
    tiles -- primebuild/kernels/fp8.py's format, what the embedded engine and the FP8 trainer compute. Plain `fp8`
    would refuse that checkpoint at load (vLLM 0.32 quantises online only through the shorthands)."""
    (argv,) = {tuple(a[a.index("--quantization"):][:2]) for a in vllm_argvs("glm5.yaml").values()
               if "--quantization" in a}
    assert argv == ("--quantization", "fp8_per_block")
    got = vllm_output["quantization"]
    assert got["fp8_per_block"]["linear"] == got["fp8_per_block"]["moe"] == [128, 128, "torch.float8_e4m3fn", True]
    assert got["fp8_per_block"]["activation"] == [1, 128, "torch.float8_e4m3fn", False]
    assert "no longer supports online quantization" in got["fp8"]["bf16_checkpoint"]
