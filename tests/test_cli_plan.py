"""`primebuild plan | validate | schema` as a person runs them: exit codes, byte-identical JSON across
processes and working directories, no torch import, and the committed JSON Schema kept up to date."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import MANIFESTS, REPO, SHIPPED, call_cli, run_cli

from primebuild.contracts.plan import plan_hash

SCHEMA_LINE = "# yaml-language-server: $schema=schema.v1.json"


def test_glm5_plan_is_byte_identical_across_processes_and_working_directories(tmp_path):
    first = run_cli("plan", "manifests/glm5.yaml", "--design", "-o", "json")
    second = run_cli("plan", "manifests/glm5.yaml", "--design", "-o", "json")
    elsewhere = run_cli("plan", str(MANIFESTS / "glm5.yaml"), "--design", "-o", "json", cwd=tmp_path)
    for result in (first, second, elsewhere):
        assert result.code == 0, result.err
        assert result.err == ""
    assert first.out == second.out == elsewhere.out
    plan = json.loads(first.out)
    assert plan["plan_hash"] == plan_hash(plan)
    owners = [(p["node"], g) for p in plan["processes"] for g in p["gpus"]]
    assert len(owners) == len(set(owners)) == 224
    assert {"prefill", "decode", "trainer", "orchestrator"} <= {p["role"] for p in plan["processes"]}
    assert first.out.endswith("}\n") and first.out.startswith('{\n  "build"')  # pretty, sorted keys
    compact = run_cli("plan", "manifests/glm5.yaml", "--design", "-o", "json", "--compact")
    assert compact.code == 0 and "\n" not in compact.out[:-1] and json.loads(compact.out) == plan
    ignored = run_cli("plan", "manifests/glm5.yaml", "--design", "--compact")  # shapes nothing without -o json
    assert ignored.code == 2 and "give it with -o json" in ignored.err


def test_a_piped_plan_at_80_columns_breaks_no_identifier_across_lines():
    """Long cells wrap at spaces and separators; a word too long for its column is shortened with "…",
    never cut in two (the full value is in `-o json`)."""
    word = re.compile(r"[A-Za-z0-9_.{}:/'=-]+")
    wide = run_cli("plan", "manifests/glm5.yaml", "--design", env={"COLUMNS": "400"})
    narrow = run_cli("plan", "manifests/glm5.yaml", "--design", env={"COLUMNS": "80"})
    assert wide.code == narrow.code == 0
    whole = set(word.findall(wide.out))
    assert max(len(line) for line in narrow.out.splitlines()) <= 80
    for line in narrow.out.splitlines():
        for match in word.finditer(line):
            token = match.group()
            shortened = line[match.end():match.end() + 1] == "…"
            assert token in whole or (shortened and any(w.startswith(token) for w in whole)), \
                f"{token!r} is a piece of an identifier: {line!r}"


@pytest.mark.parametrize("name", ["reverse-text", "reverse-text-sft", "tool-use-keys-sft", "tool-use-keys"])
def test_other_shipped_manifests_plan(name, capsys):
    result = call_cli(capsys, "plan", str(MANIFESTS / f"{name}.yaml"), "-o", "json")
    assert result.code == 0, result.err
    plan = json.loads(result.out)
    assert plan["fits"] and plan["runnable"] and plan["plan_hash"] == plan_hash(plan)


def test_glm5_plans_as_a_run(capsys):
    """The first command a cluster user types: vLLM P/D behind the router, broadcast into all 128 vLLM
    workers, FSDP x CP x EP with GLM-5's sparse attention under CP: every field applied, the plan fits."""
    result = call_cli(capsys, "plan", str(MANIFESTS / "glm5.yaml"), "-o", "json")
    assert result.code == 0, result.err
    plan = json.loads(result.out)
    assert plan["runnable"] is True and plan["fits"] is True and plan["unsupported"] == []
    roles = [p["role"] for p in plan["processes"]]
    assert roles.count("router") == 1 and roles.count("orchestrator") == 1


@pytest.mark.parametrize("name, refused_field", [("qwen3-30b-a3b", "environments[0].id")])
def test_a_plan_that_claims_unbuilt_backends_is_a_located_error(name, refused_field, capsys):
    result = call_cli(capsys, "plan", str(MANIFESTS / f"{name}.yaml"), "-o", "json")
    assert result.code == 2 and result.out == ""
    lines = [line for line in result.err.splitlines() if not line.startswith("    hint:")]
    refused = [line for line in lines if f"{name}.yaml:" in line]
    assert refused and all(":" in line.split(".yaml:", 1)[1] for line in refused)  # file:line:col
    assert any(f"{refused_field}: " in line for line in refused)
    assert "plan --design" in lines[-1]
    design = call_cli(capsys, "plan", str(MANIFESTS / f"{name}.yaml"), "--design", "-o", "json")
    plan = json.loads(design.out)
    assert design.code == 0 and plan["runnable"] is False
    fields = {u["field"] for u in plan["unsupported"]}
    assert refused_field in fields and "trainer.ep" not in fields  # EP is built (P9)
    assert "trainer.optimizer.cpu_offload" not in fields  # FSDP2's CPU offload is built
    assert "inference.engine" not in fields and "target.kind" not in fields  # its target (slurm, ssh) is built


def test_text_plan_and_validate_output(capsys):
    result = call_cli(capsys, "plan", str(MANIFESTS / "qwen3-30b-a3b.yaml"), "--design")
    assert result.code == 0, result.err
    for expected in ("qwen3-30b-a3b-math", "node map", "inference-0", "trainer", "orchestrator", "fits",
                     "design study, not runnable", "environments[0].id: "):
        assert expected in result.out
    result = call_cli(capsys, "validate", str(MANIFESTS / "glm5.yaml"), "-o", "json")
    assert result.code == 0
    assert json.loads(result.out) == {"valid": True, "name": "glm5-swe", "files": 1,
                                      "manifest_hash": json.loads(result.out)["manifest_hash"]}
    result = call_cli(capsys, "validate", str(MANIFESTS / "glm5.yaml"))
    assert result.code == 0 and "valid (glm5-swe" in result.out


def test_validate_refuses_what_plan_refuses_in_the_manifest_itself(capsys):
    """`validate` said "valid" for manifests `plan` refused: an environment typo, a field no backend applies."""
    typo = ("--set", "environments=[{id: reverse-txt}]")
    for command in (("validate",), ("plan",), ("plan", "--design")):  # a typo is no design study
        result = call_cli(capsys, *command, str(MANIFESTS / "reverse-text.yaml"), *typo)
        assert result.code == 2 and "environments[0].id: unknown environment id 'reverse-txt'" in result.err, \
            (command, result.text)
        assert "plan --design" not in result.err
    result = call_cli(capsys, "validate", str(MANIFESTS / "reverse-text.yaml"), "--set",
                      "environments=[{id: reverse-text, args: {bogus_arg: 1}}]")
    assert result.code == 2 and "environments[0].args.bogus_arg" in result.err, result.text
    # a field with no effect on CPU: refused by both, located (at the --set that wrote it), and --design
    # names the study
    unread = ("--set", "hardware.gpu_memory_gb=80")
    for command in ("validate", "plan"):
        result = call_cli(capsys, command, str(MANIFESTS / "reverse-text.yaml"), *unread)
        assert result.code == 2 and "--set: hardware.gpu_memory_gb: has no effect here" in result.err, \
            (command, result.text)
        assert "plan --design" in result.err.splitlines()[-1]
    # what this machine lacks (a taskset not installed here) is plan's to refuse, not the manifest's fault
    assert call_cli(capsys, "validate", str(MANIFESTS / "qwen3-30b-a3b.yaml")).code == 0
    assert call_cli(capsys, "plan", str(MANIFESTS / "qwen3-30b-a3b.yaml")).code == 2


def test_plan_and_validate_never_import_torch(tmp_path):
    script = f"""
import contextlib, io, json, sys
from primebuild.cli import main
codes = []
with contextlib.redirect_stdout(io.StringIO()):
    codes.append(main(["validate", {str(MANIFESTS / 'glm5.yaml')!r}]))
    codes.append(main(["plan", {str(MANIFESTS / 'glm5.yaml')!r}, "--design", "-o", "json"]))
    codes.append(main(["plan", {str(MANIFESTS / 'reverse-text.yaml')!r}]))
    codes.append(main(["schema"]))
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "vllm", "numpy"))
print(json.dumps({{"codes": codes, "heavy": heavy}}))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"codes": [0, 0, 0, 0], "heavy": []}


def test_committed_schema_is_up_to_date():
    result = run_cli("schema")
    assert result.code == 0, result.err
    committed = (MANIFESTS / "schema.v1.json").read_text()
    assert json.loads(result.out) == json.loads(committed), "run: primebuild schema > manifests/schema.v1.json"
    assert result.out.strip() == committed.strip()
    schema = json.loads(committed)
    assert schema["$schema"].startswith("https://json-schema.org/")
    assert schema["additionalProperties"] is False and "apiVersion" in schema["else"]["required"]  # unless `extends`


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_manifest_points_editors_at_the_schema(path):
    assert path.read_text().splitlines()[0] == SCHEMA_LINE


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_manifest_satisfies_the_json_schema(path):
    """What an editor checks (the JSON Schema) agrees with what primebuild accepts."""
    jsonschema = pytest.importorskip("jsonschema")
    import yaml

    schema = json.loads((MANIFESTS / "schema.v1.json").read_text())
    jsonschema.Draft202012Validator(schema).validate(yaml.safe_load(path.read_text()))


def test_the_json_schema_rejects_what_primebuild_rejects():
    jsonschema = pytest.importorskip("jsonschema")
    import yaml

    validator = jsonschema.Draft202012Validator(json.loads((MANIFESTS / "schema.v1.json").read_text()))
    doc = yaml.safe_load((MANIFESTS / "reverse-text.yaml").read_text())
    for bad in ({"trainer": {"dp_shrd": 2}}, {"hardware": {"gpu": "a100"}}, {"orchestrator": {"temperature": 99}},
                {"secrets": ["hf-token"]}):
        section, value = next(iter(bad.items()))
        broken = {**doc, section: value if isinstance(value, list) else {**doc.get(section, {}), **value}}
        assert list(validator.iter_errors(broken)), bad


def test_debug_flag_shows_the_traceback_of_a_user_error(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: primebuild/v1\nname: [x\n")
    quiet = call_cli(capsys, "validate", str(bad))
    loud = call_cli(capsys, "--debug", "validate", str(bad))
    assert quiet.code == loud.code == 2
    assert "Traceback" not in quiet.text and "Traceback" in loud.err and "UserError" in loud.err


def test_unknown_flag_and_missing_argument_exit_2(capsys):
    assert call_cli(capsys, "plan").code == 2
    assert call_cli(capsys, "plan", str(REPO / "manifests" / "glm5.yaml"), "-o", "yaml").code == 2


def test_router_replay_under_embedded_prefill_decode_plans_and_reaches_the_processes(capsys):
    """The embedded P/D servers ship routes with the KV: the plan runs it (vLLM's NIXL-style connectors,
    which cannot return routes, are refused for engine: vllm only) and wires replay into the processes."""
    result = call_cli(capsys, "plan", str(MANIFESTS / "reverse-text-moe-pd.yaml"), "-o", "json")
    assert result.code == 0, result.err
    plan = json.loads(result.out)
    assert plan["runnable"] and not plan["unsupported"]
    configs = {p["name"]: p["config"] for p in plan["processes"]}
    assert configs["prefill-0"]["disaggregation"]["role"] == "prefill"
    assert configs["decode-0"]["disaggregation"]["role"] == "decode"
    assert "router" in configs and configs["trainer"]["router_replay"]
    assert configs["orchestrator"]["router_replay"] and configs["orchestrator"]["moe_layers"] == [0, 1]
