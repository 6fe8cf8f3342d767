"""The human summary of a plan: node map, processes, memory per GPU, estimates, warnings."""

from __future__ import annotations

import shlex

from rich.console import Console
from rich.table import Table

from primebuild.contracts.memory import InferenceGroupMemory
from primebuild.contracts.model_ref import ModelRef
from primebuild.contracts.plan import Plan

GIB = 1024**3


def _size(n: float) -> str:
    """GiB for GPU-sized numbers, MiB for the tiny CPU models."""
    return f"{n / GIB:,.1f} GiB" if abs(n) >= GIB else f"{n / 1024**2:,.1f} MiB"


def _ranges(gpus: list[int]) -> str:
    if not gpus:
        return "-"
    out, start, prev = [], gpus[0], gpus[0]
    for g in [*gpus[1:], None]:
        if g is not None and g == prev + 1:
            prev = g
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if g is not None:
            start = prev = g
    return ",".join(out)


def show_plan(plan: Plan, console: Console | None = None) -> None:
    console = console or Console()
    hw, model = plan.hardware, plan.model
    gpus_total = hw.nodes * hw.gpus_per_node
    console.print(f"[bold]{plan.name}[/]  plan {plan.plan_hash[:16]}  manifest {plan.manifest_hash[:16]}")
    console.print(f"model: {_model_line(model)}  ({_params(model.total_params)} total, "
                  f"{_params(model.active_params)} active, {model.architecture})")
    console.print(f"hardware: {hw.nodes} node(s) x {hw.gpus_per_node} {hw.gpu}"
                  f" = {gpus_total} GPUs; target {plan.target.kind}")

    nodes = Table(title="node map", show_edge=False, pad_edge=False)
    # Long cells wrap at spaces; a single word too long for its column is shortened with "…" (never
    # broken in two: piped into `less` or `grep`, an identifier must stay whole). `-o json` has it all.
    nodes.add_column("node", justify="right")
    nodes.add_column("GPUs -> process", overflow="ellipsis")
    nodes.add_column("CPU processes", overflow="ellipsis")
    for node in plan.nodes:
        spans: dict[str, list[int]] = {}
        for gpu in node.gpus:
            spans.setdefault(gpu.process or "(idle)", []).append(gpu.index)
        gpu_text = "  ".join(f"{_ranges(g)}:{name}" for name, g in spans.items()) or "-"
        on_cpu = [p.name for p in plan.processes if p.node == node.index and not p.gpus]
        nodes.add_row(str(node.index), gpu_text, ", ".join(on_cpu) or "")
    console.print(nodes)

    procs = Table(title="processes (start order, then placement)", show_edge=False, pad_edge=False)
    for col in ("name", "node", "gpus", "ports", "restarts", "command"):  # the role starts every name
        procs.add_column(col, overflow="ellipsis")
    for p in sorted(plan.processes, key=lambda p: p.start_order):
        ports = ", ".join(f"{k}={v}" for k, v in p.ports.items())
        restarts = str(p.restart.max_restarts) if p.restart.policy == "on-failure" else "-"
        procs.add_row(p.name, str(p.node), _ranges(p.gpus), ports, restarts, _command(p.argv))
    console.print(procs)

    mem = Table(title="memory per GPU (per process on CPU-only nodes, a vLLM server's processes together; the orchestrator's: host memory)", show_edge=False, pad_edge=False)
    for col in ("group", "per GPU", "breakdown", "free", "fits"):
        mem.add_column(col, overflow="ellipsis")
    for group, m in plan.memory.items():
        parts = ", ".join(f"{k} {_size(v)}" for k, v in m.breakdown if v)
        extra = ""
        if isinstance(m, InferenceGroupMemory):
            extra = f"; KV {m.kv_tokens_capacity:,} tokens ({m.max_concurrent_seqs:,} full-length seqs)"
        mem.add_row(group, f"{_size(m.used_bytes)} / {_size(m.capacity_bytes)}", parts + extra,
                    _size(m.free_bytes), "[green]yes[/]" if m.fits else "[red]NO[/]")
    console.print(mem)

    console.print("[bold]estimates[/]")
    for line in plan.estimates.summary:
        console.print(f"  {line}")
    if plan.build:
        ranks = getattr(plan.build.config, "ranks", None)  # the chat SFT's trainer ranks, else this process
        where = f"on {ranks} trainer rank(s) started by" if ranks else "in"
        console.print(f"build: {plan.build.builder} -> store entry {plan.build.output} ({where} the primebuild process)")
    for w in plan.warnings:
        console.print(f"[yellow]warning:[/] {w}")
    if not plan.runnable:
        console.print("[red]design study, not runnable:[/] no built backend applies these fields")
        for u in plan.unsupported:
            console.print(f"  {u.field}: {u.message}\n    hint: {u.hint}", markup=False, highlight=False)
    console.print("[green]fits[/]" if plan.fits else "[red]does not fit[/]")


def _params(n: int) -> str:
    return f"{n / 1e9:,.1f}B" if n >= 1e9 else f"{n / 1e6:,.2f}M"


def _command(argv: list[str]) -> str:
    """The program and its module or subcommand; `plan -o json` has every argument."""
    head = argv[:3] if argv[:2] == ["{python}", "-m"] else argv[:2]
    text = shlex.join(head)
    if "-m" in argv[3:]:
        text += " … " + shlex.join(["-m", argv[argv.index("-m", 3) + 1]])
    return text + f" … ({len(argv)} args)"


def _model_line(model: ModelRef) -> str:
    if model.source == "hf":
        return f"{model.repo}@{model.revision}"
    if model.source == "path":
        return str(model.path)
    if model.source == "from_manifest":
        return f"output of {model.manifest}"
    if model.source == "from_run":
        return f"policy of run {model.run} at {'step ' + str(model.step) if model.step else 'its newest checkpoint'}"
    return f"random init ({model.facts or ''})"
