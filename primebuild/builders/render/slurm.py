"""Render a plan as one heterogeneous sbatch script (primebuild/builders/templates/slurm.sbatch.j2). Pure.

Allocations. A het-job component per group (primebuild/builders/render/groups.py), with `--nodes` the group's plan
nodes, except a CPU-only group whose plan nodes a GPU group already holds (the orchestrator of a GPU
run, on plan node 0 beside an inference server): its steps run inside that GPU group's allocation, so
the job takes exactly the manifest's `hardware.nodes`. (CPU-only hardware keeps a component per group:
`capabilities.py` refuses what that layout cannot run.)

Resources, from `hardware`. A GPU component takes whole nodes: `--gres=gpu:K --exclusive` and
`--mem=<host_memory_gb>G` (Slurm refuses the job at submission when the nodes have less). Every step
names its CPUs and memory, so that steps sharing a node do not wait on each other: a node's processes
split its `cpus_per_node` and memory evenly, and where a guest (the orchestrator: asyncio sampling,
environment scoring, hundreds of sandboxes) shares a node, the guests get half of it. CPU-only hardware
is measured, not modelled: a step takes the threads it uses and the site's default memory.

Stop grace. `--signal=B:TERM@N` warns the batch shell N seconds before the time limit; the trainer then
finishes the step in flight, publishes it and checkpoints. N is that time from the plan: the modelled
train step and weight sync, plus writing the sharded checkpoint (the trainer's states per GPU times its
GPUs) at `storage_bandwidth_gb_s` per trainer node, twice over, plus a minute; at least 120 s.

Network. `hardware.network_env` (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, …) reaches every process through
the plan's env; nothing about a site's interfaces is guessed here.

Paths. The script runs a run folder that `primebuild run` prepared (plan.json, run.json with the
resolved model): `primebuild run MANIFEST --detach` renders it, records the folder and submits it in
one command; a script submitted by hand against an unprepared folder stops at once and says so. A
relative `--run-dir` is relative to $SLURM_SUBMIT_DIR. The batch host runs the rendezvous and the
in-job supervisor with $PY (`PRIMEBUILD_PYTHON` at submission, else the rendered --python, else
`python3` on its PATH); with an image, every process step runs the image's own interpreter (pyxis).

Each process is one srun step (`--het-group=N --kill-on-bad-exit=1`, on its node of the component)
running `primebuild worker`, with the plan's literal env exported for it. Every value that reaches the
shell goes through shlex.quote.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass, replace
from pathlib import Path

import jinja2

from primebuild import __version__
from primebuild.builders.render.groups import (
    Component,
    components,
    env_literals,
    image_reference,
    node_owners,
    not_runnable_notes,
)
from primebuild.contracts.memory import TrainerGroupMemory
from primebuild.contracts.plan import Plan, ProcessSpec
from primebuild.contracts.render import RenderContext
from primebuild.errors import Problem
from primebuild.manifest.schema import SlurmTarget

SCRIPT_NAME = "job.sbatch"
MAX_REQUEUES = 3  # preemptions / node failures the job rides out (each resumes from the last checkpoint)
MIN_SIGNAL_SECONDS = 120  # the least warning before the time limit (a CPU run's is measured, not modelled)
STOP_MARGIN_SECONDS = 60  # the STOP file reaching the trainer, the supervisor ending the steps
GUEST_SHARE = 0.5  # of a node's CPUs and memory, for the CPU-only processes on a GPU group's node
IMAGE_PYTHON = "/usr/bin/python3"  # the interpreter of a primebuild image (primebuild/builders/python_layer.py)
IMAGE_WORKDIR = "/opt/primebuild/src"  # primebuild/builders/image.py SRC_DIR
DEFAULT_PYTHON = "python3"  # the batch host's, on its PATH, when neither --python nor PRIMEBUILD_PYTHON says
TEMPLATES = Path(__file__).resolve().parents[1] / "templates"


def _env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, autoescape=False)
    env.filters["q"] = shlex.quote
    return env


@dataclass(frozen=True)
class Allocation:
    """One het-job component: a group's nodes (`component`, its index the het group), and the processes
    of CPU-only groups that run on those nodes as guests."""

    component: Component
    guests: tuple[ProcessSpec, ...] = ()

    @property
    def processes(self) -> tuple[ProcessSpec, ...]:
        return self.component.processes + self.guests

    def on_node(self, node: int) -> list[ProcessSpec]:
        return [p for p in self.processes if p.node == node]


def allocations(plan: Plan) -> list[Allocation]:
    """The plan's components, with each CPU-only group folded into the first GPU group that holds all its
    plan nodes; het groups renumbered in order."""
    comps = components(plan)
    gpu = [c for c in comps if c.gpus_per_node]
    guests: dict[int, list[ProcessSpec]] = {}
    kept = []
    for c in comps:
        hosts = [h for h in gpu if set(c.nodes) <= set(h.nodes)] if not c.gpus_per_node else []
        if hosts:
            guests.setdefault(hosts[0].index, []).extend(c.processes)
        else:
            kept.append(c)
    return [Allocation(replace(c, index=i), tuple(guests.get(c.index, ()))) for i, c in enumerate(kept)]


def _threads(p: ProcessSpec) -> int:
    try:
        return max(1, int(p.env.get("OMP_NUM_THREADS", "1")))
    except ValueError:
        return 1


def _share(a: Allocation, p: ProcessSpec) -> float:
    """The fraction of its node that process `p` gets (GPU hardware)."""
    here = a.on_node(p.node)
    guests = [q for q in here if q in a.guests]
    if not guests:
        return 1 / len(here)
    mine = guests if p in a.guests else [q for q in here if q not in a.guests]
    return (GUEST_SHARE if p in a.guests else 1 - GUEST_SHARE) / len(mine)


def _sbatch(plan: Plan, a: Allocation) -> str:
    target, hw, c = plan.target_settings(SlurmTarget), plan.hardware, a.component
    tasks = max(len(a.on_node(n)) for n in c.nodes)
    opts = [f"--nodes={len(c.nodes)}", f"--ntasks-per-node={tasks}"]
    if c.gpus_per_node:
        opts += [f"--gres=gpu:{c.gpus_per_node}", "--exclusive", f"--mem={_megabytes(hw.host_memory_gb)}"]
    elif hw.gpu == "cpu":
        opts.append(f"--cpus-per-task={max(_threads(p) for p in c.processes)}")
    else:  # a CPU-only group on a node of its own (no GPU group there): the whole node
        opts += [f"--cpus-per-task={hw.cpus_per_node}", "--exclusive", f"--mem={_megabytes(hw.host_memory_gb)}"]
    opts.append(f"--time={target.time}")
    for key in ("partition", "account", "qos"):
        if getattr(target, key):
            opts.append(f"--{key}={getattr(target, key)}")
    return " ".join(shlex.quote(o) for o in opts)


def _megabytes(gigabytes: float) -> str:
    """Slurm's --mem value for `gigabytes` GiB (in MiB: a fraction of a node need not be whole GiB)."""
    return f"{max(1, int(gigabytes * 1024))}M"


def _srun(plan: Plan, a: Allocation, p: ProcessSpec) -> str:
    c, hw = a.component, plan.hardware
    node = f'--nodelist="${{NODES_{c.index}[{c.node_rank(p.node)}]}}"'
    opts = [f"--het-group={c.index}", "--nodes=1", "--ntasks=1", "--kill-on-bad-exit=1", "--unbuffered",
            f"--job-name={p.name}"]
    if hw.gpu == "cpu":
        opts.append(f"--cpus-per-task={_threads(p)}")
    else:
        share = _share(a, p)
        opts += [f"--cpus-per-task={max(1, int(hw.cpus_per_node * share))}",
                 f"--mem={_megabytes(hw.host_memory_gb * share)}"]
        if not p.gpus:
            opts.append("--gres=none")  # a guest on a GPU node: the GPUs are its neighbours'
    if p.gpus:
        # a process alone on its node's GPUs takes the GPUs it uses; processes sharing a node's GPUs overlap on
        # all of them and keep the plan's CUDA_VISIBLE_DEVICES pinning
        sharing = sum(1 for q in c.processes if q.node == p.node) > 1
        opts += [f"--gres=gpu:{c.gpus_per_node}", "--overlap"] if sharing else [f"--gres=gpu:{len(p.gpus)}"]
    return " ".join(shlex.quote(o) for o in opts) + " " + node


def signal_seconds(plan: Plan) -> int:
    """Warning before the time limit: the trainer's step in flight, its weight sync and a checkpoint."""
    trainer = plan.memory.get("trainer")
    bandwidth = plan.hardware.storage_bandwidth_gb_s
    if plan.hardware.gpu == "cpu" or not isinstance(trainer, TrainerGroupMemory) or not bandwidth:
        return MIN_SIGNAL_SECONDS
    held = trainer.breakdown.params + trainer.breakdown.master_weights + trainer.breakdown.optimizer_state
    per_gpu = trainer.host_offload_bytes_per_gpu or held
    ranks = [p for p in plan.processes if p.role == "trainer"]
    write = per_gpu * sum(len(p.gpus) for p in ranks) / (len({p.node for p in ranks}) * bandwidth * 1e9)
    estimates = plan.estimates
    step = (estimates.step.train_seconds if estimates.step else 0) + (
        estimates.weight_sync.seconds if estimates.weight_sync else 0)
    seconds = step + 2 * write + STOP_MARGIN_SECONDS
    return max(MIN_SIGNAL_SECONDS, 30 * math.ceil(seconds / 30))


def time_limit_seconds(limit: str) -> int:
    """target.time ([D-]HH:MM:SS, the schema's pattern) in seconds."""
    days, _, clock = limit.rpartition("-")
    hours, minutes, seconds = (int(x) for x in clock.split(":"))
    return int(days or 0) * 86400 + hours * 3600 + minutes * 60 + seconds


def time_limit_problem(plan: Plan) -> Problem | None:
    """A time limit within the stop warning: the job would be told to stop as it starts."""
    if plan.target.kind != "slurm":
        return None
    limit, warning = time_limit_seconds(plan.target.time), signal_seconds(plan)
    if limit > warning:
        return None
    return Problem(f"a time limit of {plan.target.time} ({limit} s) is within the stop warning: the job is told "
                   f"to stop {warning} s before its end (the trainer's step, weight sync and checkpoint, as planned), "
                   "so it would stop as it starts", field="target.time",
                   hint=f"give the job well over {warning} s")


def _container(image: str | None, ctx: RenderContext) -> str:
    """pyxis options of a process step (srun --container-*), which runs it in the image with enroot: the
    tool GPU Slurm clusters use for containers (NVIDIA's DGX and most H100/H200 sites). pyxis writes a
    registry as `REGISTRY#IMAGE`; the run folder and the store are mounted at their own paths."""
    if image is None:
        return ""
    first, _, rest = image.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        image = f"{first}#{rest}"
    mounts = '--container-mounts="$RUN_DIR:$RUN_DIR"' + "".join(shlex.quote(f",{m}:{m}") for m in ctx.mounts)
    return " ".join([shlex.quote(f"--container-image={image}"), mounts,
                     shlex.quote(f"--container-workdir={IMAGE_WORKDIR}")])


def _exports(p: ProcessSpec) -> str:
    env = env_literals(p)
    env["PRIMEBUILD_RUN_DIR"] = "${RUN_DIR}"
    parts = [f"{k}={shlex.quote(v)}" for k, v in env.items() if k != "PRIMEBUILD_RUN_DIR"]
    return " ".join(parts + ['PRIMEBUILD_RUN_DIR="$RUN_DIR"'])


def _output_header(name: str) -> str | None:
    """The job's output when the script is submitted by hand: in the folder sbatch runs in, which exists (a
    path into the run folder's logs/ did not, before the folder was prepared: sbatch then failed the launch
    and wrote nowhere why). `primebuild run` passes --output into the run folder itself."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        return None
    return f"{name}-%j.log"


def _run_dir(run_dir: str) -> str:
    """The shell value of RUN_DIR: an absolute path as given, a relative one under $SLURM_SUBMIT_DIR."""
    if run_dir.startswith("/"):
        return shlex.quote(run_dir)
    return '"$SLURM_SUBMIT_DIR"/' + shlex.quote(run_dir)


def render_slurm(plan: Plan, ctx: RenderContext) -> dict[str, str]:
    allocs = allocations(plan)
    by_name = {p.name: a for a in allocs for p in a.processes}
    owners = []
    comps = [replace(a.component, processes=a.processes) for a in allocs]
    for node, owner in enumerate(node_owners(plan, comps)):
        if owner is None:
            owners.append(shlex.quote(f"unallocated-node-{node}"))
        else:
            ci, rank = owner
            owners.append(f'"$(node_addr "${{NODES_{ci}[{rank}]}}")"')
    image = image_reference(ctx.image, plan)
    text = _env().get_template("slurm.sbatch.j2").render(
        image=image, step_python=IMAGE_PYTHON if image else None,
        version=__version__, name=plan.name, plan_hash=plan.plan_hash, notes=not_runnable_notes(plan),
        job_name=shlex.quote(plan.name), output_header=_output_header(plan.name),
        signal_seconds=signal_seconds(plan), max_requeues=MAX_REQUEUES, run_dir=_run_dir(ctx.run_dir),
        python=shlex.quote(ctx.python or DEFAULT_PYTHON), nodes=plan.hardware.nodes,
        job_nodes=sum(len(a.component.nodes) for a in allocs),
        network=sorted({k for p in plan.processes for k in p.env if k.startswith(("NCCL_", "UCX_", "GLOO_"))}),
        secrets=", ".join(sorted({s for p in plan.processes for s in p.secrets})),
        components=[{"index": a.component.index, "group": a.component.group, "nodes": a.component.nodes,
                     "gpus": a.component.gpus_per_node, "names": ", ".join(p.name for p in a.component.processes),
                     "guests": ", ".join(p.name for p in a.guests), "sbatch": _sbatch(plan, a)} for a in allocs],
        processes=[{"name": p.name, "exports": _exports(p),
                    "srun": " ".join(filter(None, [_srun(plan, by_name[p.name], p), _container(image, ctx)]))}
                   for p in sorted(plan.processes, key=lambda p: (p.start_order, by_name[p.name].component.index))],
        owners=owners, exclude=shlex.quote("--exclude=" + ",".join(ctx.exclude_nodes)) if ctx.exclude_nodes else None)
    return {SCRIPT_NAME: text}
