"""The run report: a PNG of reward, mismatch KL and throughput per step, and summary.json."""

from __future__ import annotations

from pathlib import Path

from primebuild.contracts.base import parse_contract
from primebuild.contracts.run_dir import RunDir
from primebuild.contracts.run_summary import OrchestratorSummary, RunSummary
from primebuild.runtime.metrics import read_rows


def series(rows: list[dict], role: str, name: str) -> tuple[list[int], list[float]]:
    points: dict[int, float] = {}
    for r in rows:
        if r["role"] == role and r["name"] == name and isinstance(r["value"], int | float):
            points[r["step"]] = float(r["value"])  # a resumed step overwrites the earlier attempt
    steps = sorted(points)
    return steps, [points[s] for s in steps]


def environments(rows: list[dict]) -> list[str]:
    """The environments of a run of several, in the order their eval rows first appear ([] with one)."""
    prefix, names = "eval_reward/", {}
    for r in rows:
        if r["role"] == "orchestrator" and r["name"].startswith(prefix):
            names.setdefault(r["name"].removeprefix(prefix), None)
    return list(names)


def _legend_below(ax) -> None:
    """Under the panel, not on it: inside, it covered the start of the curves (the eval curve's first point)."""
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize="small", frameon=False)


def write_report(run: RunDir) -> Path | None:
    # A Figure of its own, not pyplot: no GUI backend to pick, no global figure list, and no pyplot import
    # (~0.2 s of the report's ~1.2 s CPU, paid by every run); savefig renders with Agg.
    from matplotlib.figure import Figure

    rows = read_rows(run.metrics)
    if not rows:
        return None
    panels = [("orchestrator", "reward_mean", "rollout reward (mean)"),
              ("trainer", "behaviour_kl", "KL(inference || trainer)"),
              ("orchestrator", "tokens_per_s", "inference tokens/s")]
    fig = Figure(figsize=(15, 4 + 0.25 * len(environments(rows))))  # room for the legends
    axes = fig.subplots(1, 3)
    for ax, (role, name, title) in zip(axes, panels, strict=True):
        xs, ys = series(rows, role, name)
        ax.plot(xs, ys, marker=".", linewidth=1)
        if name == "reward_mean":
            ex, ey = series(rows, "orchestrator", "eval_reward")
            ax.lines[-1].set_label("rollouts (sampled)")
            ax.plot(ex, ey, "o-", label="held-out eval (greedy, every orchestrator.eval_every steps)")
            for env in environments(rows):  # several environments: each one's held-out curve beside the mean
                vx, vy = series(rows, "orchestrator", f"eval_reward/{env}")
                ax.plot(vx, vy, ".--", linewidth=1, label=f"held-out eval: {env}")
            _legend_below(ax)
        if name == "behaviour_kl":
            ax.lines[-1].set_label("behaviour (all samples)")
            mx, my = series(rows, "trainer", "mismatch_kl")
            ax.plot(mx, my, "s", label="mismatch (samples of the trained weights)")
            nx, ny = series(rows, "trainer", "mismatch_kl_no_replay")
            if ny:  # router replay: the same samples scored without replaying the routes
                ax.plot(nx, ny, "x", label="mismatch without router replay")
                my = my + ny
            _legend_below(ax)
            if ys and min(ys + my) > 0:
                ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("step")
    fig.tight_layout()
    out = run.report
    fig.savefig(out, dpi=90)
    return out


def summary_of(run: RunDir, extra: dict) -> RunSummary:
    """The orchestrator's record with `extra` (outcome, times) and the KL figures over the metrics."""
    summary = dict(OrchestratorSummary.read(run.orchestrator_state).model_dump(exclude_none=True), **extra)
    rows = read_rows(run.metrics)
    # Over every step where each was measured; the *_no_replay ones (router replay: the same tokens
    # scored without it) and the routing figures only exist in router-replay runs.
    for role, name in (("trainer", "mismatch_kl"), ("trainer", "behaviour_kl"), ("trainer", "mismatch_kl_no_replay"),
                       ("trainer", "behaviour_kl_no_replay"), ("trainer", "routing_agreement"),
                       ("orchestrator", "routing_bytes_per_token")):
        steps, kl = series(rows, role, name)
        if kl:
            summary[f"{name}_max"] = max(kl)
            summary[f"{name}_mean"] = sum(kl) / len(kl)
            summary[f"{name}_steps"] = len(steps)
    if summary.get("eval_reward_before") is not None and summary.get("eval_reward_after") is not None:
        summary["eval_reward_gain"] = summary["eval_reward_after"] - summary["eval_reward_before"]
    before, after = summary.get("eval_reward_before_by_env") or {}, summary.get("eval_reward_after_by_env") or {}
    if before and after:
        summary["eval_reward_gain_by_env"] = {env: after[env] - before[env] for env in after if env in before}
    return parse_contract(RunSummary, summary, where=str(run.summary))
