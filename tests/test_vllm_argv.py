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


def vllm_argvs(manifest: str) -> dict[str, list[str]]:
    result = run_cli("plan", REPO / "manifests" / manifest, "--design", "-o", "json", timeout=120)
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
        out[f"{manifest}:{process['name']}"] = filled
    assert out, f"{manifest} plans no vLLM process"
    return out


@pytest.fixture(scope="module")
def parsed() -> dict[str, str | None]:
    argvs = {}
    for manifest in GPU_MANIFESTS:
        argvs.update(vllm_argvs(manifest))
    python = vllm_python()
    proc = subprocess.run([str(python), str(REPO / "tests" / "vllm_parse_argv.py")], input=json.dumps(argvs),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("manifest", GPU_MANIFESTS)
def test_vllm_accepts_every_inference_argv(parsed, manifest):
    errors = {name: err for name, err in parsed.items() if name.startswith(manifest + ":") and err}
    assert not errors, "vLLM 0.32 refuses these argv:\n" + "\n".join(f"{k}: {v}" for k, v in errors.items())
