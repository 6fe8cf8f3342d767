"""The plan as typed data: what `primebuild plan` writes and every runner reads.

The compiler builds a `Plan`; `render_json` gives its canonical bytes (sorted keys, the hash over
everything but `plan_hash`). The worker, the supervisor, the targets, `status`, `diff` and `replay`
read plan.json back through `read_plan`, so a field they use is a field the compiler wrote.

Values known only when a run starts are placeholders the worker fills in from the run's rendezvous
file, so one plan (and one hash) serves every host:
  {run_dir}     the run folder            {model_path}  the model folder resolved at start
  {config}      this process's config file, written by the worker from the plan's `config`
  {host:N}      the address of node N     {python}      the interpreter running primebuild
  {bind:N}      the address a server on node N listens on: node N's own address as it resolves on that
                node at start, so clients on other nodes reach it; 127.0.0.1 when the run is on one host
"""

from __future__ import annotations

import json
import re
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, Field

from primebuild.contracts.base import Contract, parse_contract
from primebuild.contracts.estimates import Estimates
from primebuild.contracts.inference import InferenceServerConfig
from primebuild.contracts.memory import GroupMemory
from primebuild.contracts.model_ref import ModelRef
from primebuild.contracts.orchestrator import OrchestratorConfig
from primebuild.contracts.router import DecodeServer, RouterConfig, VllmRouterConfig  # noqa: F401  (DecodeServer: re-export)
from primebuild.contracts.sft import ChatSFTConfig, EnvSFTConfig
from primebuild.contracts.trainer import TrainerConfig
from primebuild.errors import UserError
from primebuild.hashing import canonical_json, sha256_json
from primebuild.json_file import read_json
from primebuild.manifest.schema import Hardware, Target, WeightSync

PLAN_VERSION = 2  # 2: typed process configs (no `extra` bags), `runnable`/`unsupported`, typed loss

T = TypeVar("T", bound=BaseModel)

Role = Literal["inference", "prefill", "decode", "router", "trainer", "orchestrator", "teacher"]
# Roles start in this order; each waits for the health of everything before it.
START_ORDER: dict[str, int] = {"inference": 0, "prefill": 0, "decode": 0, "teacher": 0, "router": 1, "trainer": 1,
                               "orchestrator": 2}

# Defaults that more than one side needs, in one place.
HEALTH_TIMEOUT_S = 1800.0  # an inference server loading a large model from a network disk
PROCESS_HEALTH_TIMEOUT_S = 300.0

ProcessConfig = Annotated[TrainerConfig | OrchestratorConfig | InferenceServerConfig | RouterConfig
                          | VllmRouterConfig, Field(discriminator="kind")]


# What a plan leaves for the worker to fill in on its host (primebuild/runtime/worker.py): its folders, its
# interpreter, node addresses. Manifest text may not hold them (primebuild/manifest/load.py).
PLACEHOLDER = re.compile(r"\{(run_dir|model_path|teacher_model_path|config|python|host:\d+|bind:\d+)\}")


class HealthCheck(Contract):
    kind: Literal["http", "process"]  # http: GET `url` answers 200; process: it is alive
    url: str | None = None
    timeout_s: float = PROCESS_HEALTH_TIMEOUT_S


class RestartPolicy(Contract):
    policy: Literal["never", "on-failure"] = "never"
    max_restarts: int = Field(0, ge=0)


class ProcessSpec(Contract):
    name: str
    role: Role
    group: str
    node: int = Field(ge=0)
    gpus: list[int]
    argv: list[str]
    env: dict[str, str]
    ports: dict[str, int]  # purpose -> port this process listens on
    health: HealthCheck
    restart: RestartPolicy
    start_order: int
    config: ProcessConfig | None = None  # what the worker writes to {config}; None: argv says it all
    # The Python environment the process runs in, whose interpreter `{python}` names: primebuild's own,
    # or vLLM's (its pins differ: one environment per process group, like a Nix closure per derivation).
    environment: Literal["primebuild", "vllm"] = "primebuild"
    # Which of its lines reach the terminal by default (all go to logs/): vLLM warns on every weight
    # reload about modules that have no weights, so its terminal threshold is errors.
    terminal: Literal["warnings", "errors"] = "warnings"
    secrets: list[str] = Field(default_factory=list)  # env var names passed through, never values


class GpuSlot(Contract):
    index: int
    process: str | None
    role: str | None


class NodeMap(Contract):
    index: int
    gpus: list[GpuSlot]
    processes: list[str]


class BuildSpec(Contract):
    """A manifest that builds a model (`sft:`) instead of starting processes: one store build."""

    builder: str  # builder id and version, part of the store key (primebuild/builders/derivations.py)
    output: str  # the store entry's name
    config: EnvSFTConfig | ChatSFTConfig  # the two have different `kind`s and keys, so the JSON says which


class Unsupported(Contract):
    """A manifest field no built backend applies (primebuild/builders/capabilities.py); location-free, so the plan
    hash does not depend on where the manifest lives or how it is formatted."""

    field: str
    message: str
    hint: str


class ImageRef(Contract):
    digest: str
    plan_hash: str  # the hash of the plan inside the image (without this field)


class Plan(Contract):
    plan_version: int = PLAN_VERSION
    primebuild_version: str
    name: str
    manifest_hash: str
    lock_hash: str | None
    model: ModelRef
    # The manifest's own sections, carried unchanged: readers get its types and its defaults.
    hardware: Hardware
    target: Target
    weight_sync: WeightSync
    nodes: list[NodeMap]
    processes: list[ProcessSpec]
    memory: dict[str, GroupMemory]  # by group: the inference groups by name, and `trainer`
    estimates: Estimates
    warnings: list[str]
    fits: bool
    # False when the manifest asks for something no built backend applies (`unsupported` says what,
    # located); such a plan is a design study: `plan --design` shows it, `run` refuses it.
    runnable: bool = True
    unsupported: list[Unsupported] = Field(default_factory=list)
    build: BuildSpec | None = None
    image: ImageRef | None = None
    plan_hash: str = ""

    def process(self, name: str) -> ProcessSpec:
        for p in self.processes:
            if p.name == name:
                return p
        known = ", ".join(p.name for p in self.processes)
        raise UserError(f"process {name!r} is not in plan {self.name!r}", hint=f"known processes: {known}")

    def target_settings(self, cls: type[T]) -> T:
        """The target settings as `cls` (SlurmTarget, SshTarget, ...): the plan's own when it was made for
        that kind, the kind's defaults when it is rendered for another (`render --target`)."""
        if isinstance(self.target, cls):
            return self.target
        return cls.model_construct(kind=typing.get_args(cls.model_fields["kind"].annotation)[0])

    def by_role(self, *roles: str) -> list[ProcessSpec]:
        return [p for p in self.processes if p.role in roles]

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def hashed(self) -> Plan:
        """This plan with `plan_hash` set to the sha256 of everything else."""
        return self.model_copy(update={"plan_hash": plan_hash(self.to_json())})


def plan_hash(plan_json: dict[str, Any]) -> str:
    return sha256_json({k: v for k, v in plan_json.items() if k != "plan_hash"})


def render_json(plan: Plan, *, compact: bool = False) -> str:
    """The plan's bytes: sorted keys, two-space indent (one line with `compact`); deterministic either way,
    and the hash is over the canonical JSON, not over this text."""
    if compact:
        return canonical_json(plan.to_json()) + "\n"
    return json.dumps(plan.to_json(), indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"


def read_plan(path: str | Path) -> Plan:
    data = read_json(path, what="the plan")
    if isinstance(data, dict) and data.get("plan_version") != PLAN_VERSION:
        raise UserError(f"{path}: plan_version {data.get('plan_version')!r}, this primebuild reads "
                        f"{PLAN_VERSION}", hint="recompile it from its manifest with `primebuild plan`")
    return parse_contract(Plan, data, where=str(path))


def per_process_devices(process: ProcessSpec) -> str:
    """CUDA_VISIBLE_DEVICES where a container shows the process only its own GPUs, as 0..k-1 (Kubernetes'
    device plugin), instead of the plan's node-wide indices."""
    return ",".join(str(i) for i in range(len(process.gpus)))
