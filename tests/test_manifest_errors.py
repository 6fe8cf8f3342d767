"""Malformed manifests end in one clean error: `file:line[:col]: field: message`, exit 2, no traceback.

Most cases run the real CLI in a fresh interpreter (what a person sees); the rest call
`primebuild.cli.main` in-process, which goes through the same error path, to keep the file fast.
Expected lines are computed from the text of each case, so a case stays correct when edited.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import CPU_MANIFEST, MANIFESTS, call_cli, run_cli, write

from primebuild.manifest.load import load_manifest

# cluster manifests ask for backends that are not built yet: their compiler problems show in a design study
DESIGN = ("--design",)


def line_of(text: str, needle: str, nth: int = 1) -> int:
    """1-based line of the nth line containing `needle`."""
    hits = [i for i, line in enumerate(text.splitlines(), start=1) if needle in line]
    return hits[nth - 1]


def edit(text: str, old: str, new: str) -> str:
    assert old in text, f"case is stale: {old!r} not in manifest"
    return text.replace(old, new, 1)


def glm5() -> str:
    return (MANIFESTS / "glm5.yaml").read_text()


def reverse_text_tiny() -> str:
    return CPU_MANIFEST


@dataclass
class Case:
    id: str
    text: str | bytes
    message: str  # a part of the error message (regex)
    line: int | None  # expected line in the file (None: a whole-file problem)
    field: str | None = None  # expected dotted path
    column: int | None = None
    args: tuple[str, ...] = ()
    hint: str | None = None  # a part of the hint (regex)
    subprocess: bool = True


def _cases() -> list[Case]:
    cpu = CPU_MANIFEST
    cases = []

    def add(**kw):
        cases.append(Case(**kw))

    add(id="yaml-syntax", text="apiVersion: primebuild/v1\nname: a: b\n", line=2, column=8,
        message="YAML syntax error: mapping values are not allowed here")
    add(id="tab-indentation", text=edit(cpu, "  init: random", "\tinit: random"), line=line_of(cpu, "init: random"),
        column=1, message="tab character used for indentation", hint="spaces")
    dup = edit(cpu, "  ranks: 1\n", "  ranks: 1\n  precision: bf16\n")
    add(id="duplicate-key", text=dup, line=line_of(dup, "precision:", 3), field="trainer.precision",
        message=rf"duplicate key 'precision' \(first defined on line {line_of(dup, 'precision:', 2)}\)")
    typo = edit(cpu, "  ranks: 1", "  dp_shrd: 1")
    add(id="unknown-key-did-you-mean", text=typo, line=line_of(typo, "dp_shrd"), column=3, field="trainer.dp_shrd",
        message="unknown field 'dp_shrd'", hint="did you mean 'dp_shard'")
    # a value of the wrong type is refused, not converted (pydantic's lax mode made `true` 1 and "64" 64)
    flag = edit(cpu, "  ranks: 1", "  ranks: true")
    add(id="bool-for-an-int", text=flag, line=line_of(flag, "ranks: true"), field="trainer.ranks",
        message="valid integer", subprocess=False)
    quoted = edit(cpu, "  seq_len: 64", '  seq_len: "64"')
    add(id="string-for-an-int", text=quoted, line=line_of(quoted, "seq_len"), field="orchestrator.seq_len",
        message="valid integer", subprocess=False)
    one = edit(cpu, "  micro_batch_tokens: 4096", "  micro_batch_tokens: 4096\n  activation_checkpointing: 1")
    add(id="int-for-a-bool", text=one, line=line_of(one, "activation_checkpointing"),
        field="trainer.activation_checkpointing", message="valid boolean", subprocess=False)
    nul = edit(cpu, "name: tiny", "name: tiny\x00")
    add(id="nul-character", text=nul, line=line_of(nul, "name:"), column=11, message="U\\+0000 is not allowed",
        hint="plain text", subprocess=False)
    typo_top = edit(cpu, "inference:", "infrence:")
    add(id="unknown-section-did-you-mean", text=typo_top, line=line_of(typo_top, "infrence"), field="infrence",
        message="unknown field 'infrence'", hint="did you mean 'inference'", subprocess=False)
    wrong = edit(cpu, "  ranks: 1", "  ranks: many")
    add(id="wrong-type", text=wrong, line=line_of(wrong, "ranks"), field="trainer.ranks",
        message="valid integer")
    section = edit(cpu, "trainer:\n  ranks: 1\n  precision: fp32\n  micro_batch_tokens: 4096\n", "trainer: 3\n")
    add(id="section-not-a-mapping", text=section, line=line_of(section, "trainer: 3"), field="trainer",
        message="valid dictionary", subprocess=False)
    hot = edit(cpu, "  group_size: 8", "  group_size: 8\n  temperature: 99")
    add(id="out-of-range", text=hot, line=line_of(hot, "temperature"), field="orchestrator.temperature",
        message="less than or equal to 10")
    util = edit(cpu, "  precision: fp32\ntrainer", "  precision: fp32\n  gpu_memory_utilization: 1.5\ntrainer")
    add(id="out-of-range-float", text=util, line=line_of(util, "gpu_memory_utilization"),
        field="inference.gpu_memory_utilization", message="less than or equal to 0.98", subprocess=False)
    add(id="custom-tag", text=edit(cpu, "name: tiny", "name: !env HOME"), line=2, column=7, field="name",
        message="unsupported YAML tag '!env'", hint="plain data")
    add(id="empty-file", text="", line=None, message="the manifest is empty", hint="apiVersion")
    add(id="comments-only", text="# nothing here yet\n", line=None, message="the manifest is empty",
        subprocess=False)
    add(id="list-not-mapping", text="- apiVersion: primebuild/v1\n- name: x\n", line=1,
        message="a manifest must be a mapping of fields, not a list")
    add(id="scalar-not-mapping", text="just words\n", line=1, message="must be a mapping of fields, not a str",
        subprocess=False)
    add(id="non-utf8", text=cpu.encode().replace(b"name: tiny", b"name: ti\xffny"), line=2, column=9,
        message="byte 0xff is not valid UTF-8", hint="UTF-8")
    add(id="latin1-file", text="apiVersion: primebuild/v1\ndescription: caf\xe9\n".encode("latin-1"), line=2,
        column=17, message="byte 0xe9 is not valid UTF-8", subprocess=False)
    add(id="absurd-nesting-flow", text="apiVersion: primebuild/v1\nx: " + "[" * 1000 + "]" * 1000 + "\n",
        line=None, message="nests deeper than 64 levels")
    block = "apiVersion: primebuild/v1\n" + "".join("  " * i + f"k{i}:\n" for i in range(100)) + "  " * 100 + "v: 1\n"
    add(id="absurd-nesting-block", text=block, line=line_of(block, "k65:"), message="nests deeper than 64 levels",
        subprocess=False)
    add(id="missing-apiversion", text=edit(cpu, "apiVersion: primebuild/v1\n", ""), line=1,
        message="missing `apiVersion`", hint="apiVersion: primebuild/v1")
    add(id="newer-apiversion", text=edit(cpu, "primebuild/v1", "primebuild/v2"), line=1, field="apiVersion",
        message="primebuild/v2 is newer than this primebuild understands", hint="upgrade primebuild")
    add(id="unknown-apiversion", text=edit(cpu, "primebuild/v1", "kubeflow/v1"), line=1, field="apiVersion",
        message="unknown apiVersion 'kubeflow/v1'", subprocess=False)
    for i, bad in enumerate(["../../etc/passwd", "a;rm -rf ~", "$(id)", "two words", "x" * 64, ".hidden"]):
        text = edit(cpu, "name: tiny", f"name: {bad!r}".replace("'", '"'))
        add(id=f"unsafe-name-{i}", text=text, line=2, field="name", message="is not a safe name",
            subprocess=i == 0)
    add(id="unknown-gpu-type", text=edit(cpu, "  gpu: cpu", "  gpu: a100"), line=line_of(cpu, "gpu: cpu"),
        field="hardware.gpu", message="got 'a100'; expected one of 'h100', 'h200', 'b200' or 'cpu'",
        subprocess=False)
    secret = cpu + "secrets: [HF_TOKEN, hf-token]\n"
    add(id="bad-secret-name", text=secret, line=line_of(secret, "secrets"), field="secrets[1]",
        message="should match pattern", subprocess=False)
    two = edit(cpu, "  init: random", "  init: random\n  hf: Qwen/Qwen3-0.6B")
    add(id="two-model-sources", text=two, line=line_of(two, "model:"), field="model",
        message="give exactly one of hf, path, from_manifest, from_run, init \\(got hf, init\\)")
    no_source = edit(cpu, "  init: random\n", "")
    add(id="no-model-source", text=no_source, line=line_of(no_source, "model:"), field="model",
        message="got none", subprocess=False)
    shape = edit(cpu, "  group_size: 8", "  group_size: 7")
    add(id="rollouts-not-multiple-of-group", text=shape, line=line_of(shape, "rollouts_per_step"), column=3,
        field="orchestrator.rollouts_per_step", message=r"rollouts_per_step \(64\) must be a multiple of group_size \(7\)",
        hint="rollouts_per_step: 63, or a group_size dividing 64", subprocess=False)
    long = edit(cpu, "  max_completion_tokens: 16", "  max_completion_tokens: 100")
    add(id="completion-longer-than-sequence", text=long, line=line_of(long, "max_completion_tokens"), column=3,
        field="orchestrator.max_completion_tokens", message=r"max_completion_tokens \(100\) exceeds seq_len \(64\)",
        hint="seq_len: 100 or more", subprocess=False)
    vllm_fp8 = edit(cpu, "  engine: embedded\n  precision: fp32", "  engine: vllm\n  precision: fp8")
    add(id="vllm-cpu-fp8", text=vllm_fp8, line=line_of(vllm_fp8, "  precision: fp8"), field="inference.precision",
        message="vllm-cpu: FP8 is not tested on CPUs", hint="precision: fp32", subprocess=False)

    # compiler problems (need hardware and model facts): located in the manifest, with a concrete fix
    g = glm5()
    tp = edit(g, "prefill: {replicas: 4, nodes_per_replica: 1, tp: 8,", "prefill: {replicas: 4, nodes_per_replica: 1, tp: 16,")
    add(id="tp-larger-than-node", args=DESIGN, text=tp, line=line_of(tp, "prefill:"), field="inference.disaggregation.prefill.tp",
        message="prefill: tp=16 exceeds the 8 GPUs of a node", hint="tp <= 8", subprocess=False)
    ep = edit(g, "  ep: 8\n  precision: bf16", "  ep: 3\n  precision: bf16")
    add(id="experts-not-divisible-by-ep", args=DESIGN, text=ep, line=line_of(ep, "  ep: 3"), column=3, field="trainer.ep",
        message="256 experts are not divisible by ep=3", hint="ep must divide 256")
    world = edit(g, "dp_shard: 24", "dp_shard: 16")
    add(id="trainer-gpu-count-mismatch", args=DESIGN, text=world, line=line_of(world, "dp_shard: 16"), field="trainer.dp_shard",
        message=r"world size dp_replicate\*dp_shard\*cp\*tp = 64 but its 12 node\(s\) hold 96 GPUs",
        hint="set dp_shard: 24", subprocess=False)
    few = edit(g, "  nodes: 28", "  nodes: 12")
    add(id="inference-needs-more-nodes", args=DESIGN, text=few, line=line_of(few, "decode:"), field="inference.disaggregation.decode.replicas",
        message="inference needs 16 nodes but the cluster has 12", hint="add nodes")
    braces = edit(cpu, "  - id: reverse-text", "  - id: reverse-text\n    args: {prompt_format: 'run {python}'}")
    add(id="plan-placeholder-in-manifest-text", text=braces, line=line_of(braces, "prompt_format"),
        field="environments[0].args.prompt_format", message="{python} is a placeholder each process fills in")
    dense = edit(cpu, "  precision: fp32\ntrainer", "  precision: fp32\n  router_replay: true\ntrainer")
    add(id="router-replay-on-dense-model", text=dense, line=line_of(dense, "router_replay"),
        field="inference.router_replay", message="router_replay needs a MoE model", hint="router_replay: false")
    pinned = edit(cpu, "  precision: fp32\ntrainer", "  precision: fp32\n  host: 192.0.2.2\ntrainer")
    add(id="inference-bound-where-no-client-reaches", text=pinned, line=line_of(pinned, "host: 192"),
        field="inference.host", message="answers none of them", hint=None, subprocess=False)
    split = edit(cpu, "  ranks: 1\n", "  ranks: 1\n  tp: 2\n")  # the hint once said "set dp_shard: 1", its value
    add(id="ranks-against-a-tp-layout", text=split, line=line_of(split, "ranks: 1"), field="trainer.ranks",
        message=r"ranks=1 but dp_replicate\*dp_shard\*cp\*tp=2", hint="set ranks: 2", subprocess=False)
    lonely = edit(cpu, "  group_size: 8", "  group_size: 1")
    add(id="group-of-one-trains-nothing", text=lonely, line=line_of(lonely, "group_size: 1"),
        field="orchestrator.group_size", message="every advantage is 0", hint="group_size >= 2", subprocess=False)
    fat = edit(g, "cpu_offload: true}", "cpu_offload: false}")
    add(id="trainer-does-not-fit", args=DESIGN, text=fat, line=line_of(fat, "  dp_shard: 24"), field="trainer.dp_shard",
        message=r"trainer: [\d.]+ GiB per GPU needed, [\d.]+ GiB available \(short by [\d.]+ GiB\)",
        hint=r"cpu_offload: true \(frees [\d.]+ GiB\)")
    starved = edit(cpu, "  host_memory_gb: 16", "  host_memory_gb: 0.1")
    add(id="cpu-inference-does-not-fit", text=starved, line=line_of(starved, "inference:"), field="inference.tp",
        message=r"leave no room for one 64-token sequence in [\d.]+ GiB per process",
        hint=r"a larger hardware\.host_memory_gb", subprocess=False)
    many = edit(cpu, "  engine: embedded", "  engine: embedded\n  replicas: 1000000")
    add(id="cpu-replicas-beyond-cpus", text=many, line=line_of(many, "replicas"), field="inference.replicas",
        message="1000000 inference replicas on one CPU node with 2 CPUs", hint="at most 2 replicas", subprocess=False)
    q = (MANIFESTS / "qwen3-30b-a3b.yaml").read_text()
    ports = edit(q, "  replicas: 4\n", "  replicas: 4\n  port: 65534\n")
    add(id="inference-ports-beyond-65535", args=DESIGN, text=ports, line=line_of(ports, "port: 65534"), field="inference.port",
        message="4 inference replicas from port 65534 need ports up to 65537", subprocess=False)
    no_facts = edit(cpu, "  facts: models/reverse-text-tiny.json", '  facts: ""')
    add(id="empty-facts-path", text=no_facts, line=line_of(no_facts, "facts"), field="model.facts",
        message="architecture facts not found", subprocess=False)
    return cases


CASES = _cases()


def assert_clean_error(result, case: Case, shown: str) -> None:
    assert "Traceback" not in result.text, result.text
    assert result.code == 2, result.text
    assert result.err.startswith("error: "), result.text
    where = shown if case.line is None else f"{shown}:{case.line}"
    if case.column is not None:
        where += f":{case.column}"
    located = [ln for ln in result.err.splitlines() if ln.removeprefix("error: ").startswith(where + (":" if case.line else ""))]
    assert located, f"no line starts with {where!r}:\n{result.err}"
    first = located[0]
    if case.field:
        assert f" {case.field}: " in first, f"field {case.field!r} missing:\n{result.err}"
    assert re.search(case.message, result.err), f"message {case.message!r} missing:\n{result.err}"
    if case.hint:
        assert re.search(r"hint: .*" + case.hint, result.err), f"hint {case.hint!r} missing:\n{result.err}"


def test_at_least_25_distinct_cases():
    assert len({c.id for c in CASES}) == len(CASES) >= 25
    assert sum(c.subprocess for c in CASES) >= 15


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_malformed_manifest_is_a_clean_error(case: Case, workdir: Path, capsys, monkeypatch):
    write(workdir, "m.yaml", case.text)
    command = "plan" if case.id != "yaml-syntax" else "validate"
    if case.subprocess:
        result = run_cli(command, "m.yaml", *case.args, cwd=workdir)
    else:
        monkeypatch.chdir(workdir)
        result = call_cli(capsys, command, "m.yaml", *case.args)
    assert_clean_error(result, case, "m.yaml")


def test_unsafe_python_tag_is_refused_and_never_executed(workdir: Path, capsys, monkeypatch):
    marker = workdir / "PWNED"
    text = CPU_MANIFEST.replace("name: tiny", f'name: !!python/object/apply:os.system ["touch {marker}"]')
    write(workdir, "m.yaml", text)
    result = run_cli("plan", "m.yaml", cwd=workdir)
    assert result.code == 2 and "Traceback" not in result.text
    assert "m.yaml:2:7: name: unsupported YAML tag 'tag:yaml.org,2002:python/object/apply:os.system'" in result.err
    assert "hint: manifests are plain data: remove the tag" in result.err
    assert "valid string" not in result.err  # the refused value is not reported a second time as a type error
    assert not marker.exists()
    # the other constructors that PyYAML's unsafe loader would honour
    monkeypatch.chdir(workdir)
    for tag in ("!!python/name:os.system", "!!python/object/new:os.system [x]", "!!python/module:os"):
        write(workdir, "m.yaml", CPU_MANIFEST.replace("name: tiny", f"name: {tag}"))
        result = call_cli(capsys, "validate", "m.yaml")
        assert result.code == 2 and "unsupported YAML tag" in result.err and "Traceback" not in result.text
    write(workdir, "m.yaml", f'!!python/object/apply:os.system ["touch {marker}"]\n')  # on the whole document
    result = call_cli(capsys, "validate", "m.yaml")
    assert result.code == 2 and "m.yaml:1:1: unsupported YAML tag" in result.err and "NoneType" not in result.err
    assert not marker.exists()


def test_alias_bomb_is_refused_fast(workdir: Path):
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, cur in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"{cur}: &{cur} [" + ",".join([f"*{prev}"] * 9) + "]")
    write(workdir, "m.yaml", "apiVersion: primebuild/v1\n" + "\n".join(lines) + "\n")
    result = run_cli("validate", "m.yaml", cwd=workdir)  # expanded, 9^9 values would outlast run_cli's timeout
    assert result.code == 2 and "Traceback" not in result.text
    assert re.search(r"m\.yaml:\d+:\d+: .*document expands to more than \d+ values \(alias bomb\?\)", result.err)


def test_multiple_problems_reported_at_once_sorted_by_line(workdir: Path):
    text = """\
apiVersion: primebuild/v1
name: bad/name
model: {init: random, facts: models/reverse-text-tiny.json}
hardware: {gpu: cpu, gpus_per_node: 0, nodes: 0}
trainer:
  dp_shrd: 2
  precision: fp64
orchestrator: {temperature: 99}
environments: [{id: x, wieght: 2}]
secrets: [bad-secret]
"""
    write(workdir, "m.yaml", text)
    result = run_cli("validate", "m.yaml", cwd=workdir)
    assert result.code == 2 and "Traceback" not in result.text
    located = re.findall(r"^(?:error: )?m\.yaml:(\d+):(\d+): (\S+): ", result.err, flags=re.M)
    assert [(int(line), field) for line, _, field in located] == [
        (2, "name"), (4, "hardware.nodes"), (6, "trainer.dp_shrd"), (7, "trainer.precision"),
        (8, "orchestrator.temperature"), (9, "environments[0].wieght"), (10, "secrets[0]")]


def test_duplicate_keys_and_schema_errors_together(workdir: Path, capsys, monkeypatch):
    text = CPU_MANIFEST.replace("name: tiny", "name: tiny\nname: tiny2").replace("  ranks: 1", "  ranks: 0")
    write(workdir, "m.yaml", text)
    monkeypatch.chdir(workdir)
    result = call_cli(capsys, "validate", "m.yaml")
    assert result.code == 2
    assert "m.yaml:3:1: name: duplicate key 'name'" in result.err
    assert f"m.yaml:{line_of(text, 'ranks')}:3: trainer.ranks: Input should be greater than or equal to 1" in result.err


def test_older_apiversion_migrates_with_a_note(workdir: Path):
    text = (CPU_MANIFEST.replace("primebuild/v1", "primebuild/v1alpha1")
            .replace("  ranks: 1", "  ranks: 2\n  fsdp: 2")
            .replace("  group_size: 8", "  batch_size: 64\n  group_size: 8").replace("  rollouts_per_step: 64\n", ""))
    write(workdir, "m.yaml", text)
    result = run_cli("plan", "m.yaml", "-o", "json", cwd=workdir)
    assert result.code == 0, result.err
    assert "note: m.yaml: migrated apiVersion primebuild/v1alpha1 -> primebuild/v1" in result.err
    assert "trainer.fsdp is now trainer.dp_shard" in result.err
    assert "orchestrator.batch_size is now orchestrator.rollouts_per_step" in result.err
    import json

    plan = json.loads(result.out)
    trainer = next(p for p in plan["processes"] if p["role"] == "trainer")
    argv = trainer["argv"]
    assert argv[argv.index("--nproc-per-node") + 1] == "2"  # fsdp: 2 became dp_shard: 2
    assert next(p for p in plan["processes"] if p["role"] == "orchestrator")["config"]["rollouts_per_step"] == 64


def test_v1alpha1_with_old_and_new_name_is_refused(workdir: Path, capsys, monkeypatch):
    text = CPU_MANIFEST.replace("primebuild/v1", "primebuild/v1alpha1").replace("  ranks: 1", "  fsdp: 1\n  dp_shard: 1")
    write(workdir, "m.yaml", text)
    monkeypatch.chdir(workdir)
    result = call_cli(capsys, "validate", "m.yaml")
    assert result.code == 2 and "both 'fsdp' (v1alpha1) and 'dp_shard' (v1) are set" in result.err


def test_v1_moved_fields_migrate_with_a_note(workdir: Path):
    # lr and warmup_steps moved from orchestrator: to trainer.optimizer: (only the trainer reads them), and
    # cispo's is_cap became clip_high (grpo's name for the same bound); an old manifest still loads.
    text = CPU_MANIFEST.replace("  group_size: 8", "  group_size: 8\n  lr: 3.0e-4\n  warmup_steps: 7\n"
                                "  loss: {name: cispo, is_cap: 3.0}")
    write(workdir, "m.yaml", text)
    result = run_cli("plan", "m.yaml", "-o", "json", "--set", "orchestrator.max_steps=5", cwd=workdir)
    assert result.code == 0, result.err
    assert "orchestrator.lr is now trainer.optimizer.lr" in result.err
    assert "orchestrator.warmup_steps is now trainer.optimizer.warmup_steps" in result.err
    assert "orchestrator.loss.is_cap of cispo is now orchestrator.loss.clip_high" in result.err
    import json

    config = next(p for p in json.loads(result.out)["processes"] if p["role"] == "trainer")["config"]
    assert (config["lr"], config["warmup_steps"], config["loss"]) == (3e-4, 7, {"name": "cispo", "clip_high": 3.0})


def test_v1_moved_field_set_twice_is_refused(workdir: Path, capsys, monkeypatch):
    text = CPU_MANIFEST.replace("  group_size: 8", "  group_size: 8\n  lr: 3.0e-4")
    write(workdir, "m.yaml", text)
    monkeypatch.chdir(workdir)
    result = call_cli(capsys, "validate", "m.yaml", "--set", "trainer.optimizer.lr=0.001")
    assert result.code == 2
    assert f"m.yaml:{line_of(text, '  lr:')}:3: orchestrator.lr: both orchestrator.lr and trainer.optimizer.lr " \
        "are set" in result.err


@pytest.mark.parametrize(("sets", "message"), [
    (["trainer.nosuch=3"], r"--set: trainer\.nosuch: unknown field 'nosuch'"),
    (["trainer.dp_shrd=3"], r"--set: trainer\.dp_shrd: unknown field 'dp_shrd'\n    hint: did you mean 'dp_shard'"),
    (["trainer.ranks=abc"], r"--set: trainer\.ranks: Input should be a valid integer"),
    (["trainer.ranks"], r"--set #1: expected PATH=VALUE, got 'trainer\.ranks'"),
    (["seed=1", "trainer..ranks=1"], r"--set #2: bad field path 'trainer\.\.ranks'"),
    (["hardware.gpu=a100"], r"--set: hardware\.gpu: got 'a100'"),
    (["hardware.nodes=true"], r"--set: hardware\.nodes: Input should be a valid integer"),
    (["environments.0.id=wordle"], r"--set #1: environments\.0\.id: environments is a list, and --set cannot reach"),
    (["environments[0].id=wordle"], r"--set #1: .*environments is a list.*\n    hint: set the whole list"),
])
def test_bad_set_is_a_clean_error(sets, message, workdir: Path, capsys, monkeypatch):
    write(workdir, "m.yaml", CPU_MANIFEST)
    args = [a for s in sets for a in ("--set", s)]
    if sets == ["trainer.nosuch=3"]:  # one through the real CLI
        result = run_cli("plan", "m.yaml", *args, cwd=workdir)
    else:
        monkeypatch.chdir(workdir)
        result = call_cli(capsys, "plan", "m.yaml", *args)
    assert result.code == 2 and "Traceback" not in result.text
    assert re.search(message, result.err), result.err


def test_missing_file_and_directory_are_clean_errors(workdir: Path, capsys, monkeypatch):
    monkeypatch.chdir(workdir)
    result = call_cli(capsys, "validate", "nope.yaml")
    assert result.code == 2 and "nope.yaml: file not found" in result.err
    (workdir / "d.yaml").mkdir()
    result = call_cli(capsys, "plan", "d.yaml")
    assert result.code == 2 and "Traceback" not in result.text
    os.mkfifo(workdir / "pipe.yaml")  # reading it would wait for a writer for ever
    result = call_cli(capsys, "validate", "pipe.yaml")
    assert result.code == 2 and "pipe.yaml: is a pipe or a device, not a manifest file" in result.err


def test_a_stale_lock_says_how_to_refresh_it_for_the_same_command(workdir: Path, capsys, monkeypatch):
    monkeypatch.chdir(workdir)
    write(workdir, "m.yaml", CPU_MANIFEST)
    assert call_cli(capsys, "lock", "m.yaml", "--offline", "--lock", "m.lock").code == 0
    result = call_cli(capsys, "plan", "m.yaml", "--lock", "m.lock", "--set", "orchestrator.max_steps=5")
    assert result.code == 2 and "stale lock" in result.err
    assert "`primebuild lock m.yaml --set orchestrator.max_steps=5 --lock m.lock`" in result.err, result.err


def test_missing_facts_file_is_a_clean_error(workdir: Path, capsys, monkeypatch):
    write(workdir, "m.yaml", CPU_MANIFEST.replace("reverse-text-tiny.json", "nope.json"))
    monkeypatch.chdir(workdir)
    result = call_cli(capsys, "plan", "m.yaml")
    assert result.code == 2
    assert f"m.yaml:{line_of(CPU_MANIFEST, 'facts:')}:3: model.facts: architecture facts not found" in result.err


def test_an_exponent_without_a_dot_is_a_number(workdir: Path):
    """YAML 1.1 reads `1e-4` as a string; people write it for a learning rate and mean the number."""
    write(workdir, "m.yaml", CPU_MANIFEST.replace("  ranks: 1\n", "  ranks: 1\n  optimizer: {lr: 1e-4}\n"))
    loaded = load_manifest(workdir / "m.yaml", ["orchestrator.temperature=5E-1"])
    assert loaded.manifest.trainer.optimizer.lr == 1e-4 and loaded.manifest.orchestrator.temperature == 0.5


def test_lock_refuses_what_it_cannot_read_or_write_before_resolving_anything(workdir: Path, capsys, monkeypatch):
    monkeypatch.chdir(workdir)
    write(workdir, "m.yaml", CPU_MANIFEST.replace("reverse-text-tiny.json", "nope.json"))
    result = call_cli(capsys, "lock", "m.yaml", "--offline")
    assert result.code == 2 and "model.facts: architecture facts not found" in result.err, result.text
    write(workdir, "m.yaml", CPU_MANIFEST.replace("  - id: reverse-text", "  - id: reverse-txt"))
    result = call_cli(capsys, "lock", "m.yaml", "--offline")  # a typo, not a verifiers taskset to install
    assert result.code == 2 and "environments[0].id: unknown environment id 'reverse-txt'" in result.err, result.text
    write(workdir, "m.yaml", CPU_MANIFEST)
    (workdir / "models" / "reverse-text-tiny.json").write_bytes(b"\xff\xfe{")
    result = call_cli(capsys, "lock", "m.yaml", "--offline")
    assert result.code == 2 and "not UTF-8" in result.err, result.text
    (workdir / "a-file").write_text("")
    result = call_cli(capsys, "lock", "m.yaml", "--offline", "--lock", "a-file/m.lock")
    assert result.code == 2 and "no lock can be written there" in result.err and "Not a directory" in result.err
    assert "Traceback" not in result.text and not list(workdir.rglob("*.lock")) and not list(workdir.rglob(".*tmp"))


def test_a_manifest_starting_from_its_own_output_is_a_clean_error(workdir: Path, capsys, monkeypatch):
    text = CPU_MANIFEST.replace("  init: random\n", "  from_manifest: m.yaml\n")
    write(workdir, "m.yaml", text)
    monkeypatch.chdir(workdir)
    result = call_cli(capsys, "plan", "m.yaml")
    assert result.code == 2 and "Traceback" not in result.text
    line = line_of(text, "from_manifest:")
    assert f"m.yaml:{line}:3: model.from_manifest: a manifest cannot start from its own output" in result.err


def test_more_trainer_ranks_than_cpus_is_a_clean_error(workdir: Path, capsys, monkeypatch):
    write(workdir, "m.yaml", CPU_MANIFEST)
    monkeypatch.chdir(workdir)
    result = call_cli(capsys, "plan", "m.yaml", "--set", "trainer.dp_shard=1000", "--set", "trainer.ranks=64")
    assert result.code == 2 and "Traceback" not in result.text
    assert "trainer.dp_shard: trainer: 1000 ranks" in result.err and "CPUs" in result.err
