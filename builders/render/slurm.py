"""Render a plan as one heterogeneous sbatch script (builders/templates/slurm.sbatch.j2). Pure.

Component per group (builders/render/groups.py): `--nodes` is the group's plan nodes, `--gres=gpu:K`
the GPUs a node of it uses; GPU components take whole nodes (`--exclusive`, as the placement assumes),
CPU-only ones the threads their processes use. Each process is one srun step (`--het-group=N
--kill-on-bad-exit=1`, on its node of the component) running `primebuild worker`, with the plan's
literal env exported for it. Every value that reaches the shell goes through shlex.quote.
"""

from __future__ import annotations

import shlex
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
from primebuild.contracts.plan import Plan, ProcessSpec
from primebuild.contracts.render import RenderContext

SCRIPT_NAME = "job.sbatch"
MAX_REQUEUES = 3  # preemptions / node failures the job rides out (each resumes from the last checkpoint)
SIGNAL_SECONDS = 120  # before the time limit, the batch shell gets SIGTERM: checkpoint and stop cleanly
ORCHESTRATOR_CPUS = 16
IMAGE_PYTHON = "/usr/bin/python3"  # the interpreter of a primebuild image (builders/python_layer.py)
IMAGE_WORKDIR = "/opt/primebuild/src"  # builders/image.py SRC_DIR
TEMPLATES = Path(__file__).resolve().parents[1] / "templates"


def _env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, autoescape=False)
    env.filters["q"] = shlex.quote
    return env


def _threads(p: ProcessSpec) -> int:
    try:
        return max(1, int(p.env.get("OMP_NUM_THREADS", "1")))
    except ValueError:
        return 1


def _sbatch(plan: Plan, c: Component) -> str:
    target = plan.target
    opts = [f"--nodes={len(c.nodes)}", f"--ntasks-per-node={c.tasks_per_node}"]
    if c.gpus_per_node:
        opts += [f"--gres=gpu:{c.gpus_per_node}", "--exclusive"]
    elif plan.hardware.get("gpu") == "cpu":
        opts.append(f"--cpus-per-task={max(_threads(p) for p in c.processes)}")
    else:  # the orchestrator of a GPU run: asyncio sampling plus environment scoring
        opts.append(f"--cpus-per-task={min(ORCHESTRATOR_CPUS, plan.hardware.get('cpus_per_node', 1))}")
    opts.append(f"--time={target.get('time', '24:00:00')}")
    for key in ("partition", "account", "qos"):
        if target.get(key):
            opts.append(f"--{key}={target[key]}")
    return " ".join(shlex.quote(o) for o in opts)


def _srun(c: Component, p: ProcessSpec) -> str:
    node = f'--nodelist="${{NODES_{c.index}[{c.node_rank(p.node)}]}}"'
    opts = [f"--het-group={c.index}", "--nodes=1", "--ntasks=1", "--kill-on-bad-exit=1", "--unbuffered",
            f"--job-name={p.name}"]
    if p.gpus:
        # a process alone on its node takes the GPUs it uses; processes sharing a node's GPUs overlap on all
        # of them and keep the plan's CUDA_VISIBLE_DEVICES pinning
        opts += ([f"--gres=gpu:{c.gpus_per_node}", "--overlap"] if c.shares_node(p) else [f"--gres=gpu:{len(p.gpus)}"])
    else:
        opts.append(f"--cpus-per-task={_threads(p)}")
    return " ".join(shlex.quote(o) for o in opts) + " " + node


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


def _output_header(run_dir: str) -> str | None:
    """sbatch reads #SBATCH values in double quotes; a path it cannot carry that way is left to the
    command line (`primebuild run` always passes --output itself)."""
    path = f"{run_dir}/logs/job-%j.log"
    if any(ch in run_dir for ch in '"\\\n%'):
        return None
    return path


def render_slurm(plan: Plan, ctx: RenderContext) -> dict[str, str]:
    comps = components(plan)
    by_name = {p.name: c for c in comps for p in c.processes}
    owners = []
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
        job_name=shlex.quote(plan.name), output_header=_output_header(ctx.run_dir),
        signal_seconds=SIGNAL_SECONDS, max_requeues=MAX_REQUEUES, run_dir=ctx.run_dir, python=ctx.python,
        secrets=", ".join(sorted({s for p in plan.processes for s in p.secrets})),
        components=[{"index": c.index, "group": c.group, "nodes": c.nodes, "gpus": c.gpus_per_node,
                     "names": ", ".join(p.name for p in c.processes), "sbatch": _sbatch(plan, c)} for c in comps],
        processes=[{"name": p.name, "exports": _exports(p),
                    "srun": " ".join(filter(None, [_srun(by_name[p.name], p), _container(image, ctx)]))}
                   for p in sorted(plan.processes, key=lambda p: (p.start_order, by_name[p.name].index))],
        owners=owners)
    return {SCRIPT_NAME: text}
