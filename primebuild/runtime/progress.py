"""The progress of a run, read from metrics.jsonl as the processes write it.

One line per trained step: reward of its rollouts, the trainer's KL to the sampling policy (behaviour:
numerics plus async staleness; mismatch: numerics alone, on samples drawn with the trained weights, "-"
when every sample is stale), off-policy lag, inference tokens/s and the policy version that sampled it.
With router replay each KL is followed by "/" and the same KL without replay (the trainer scores the
batch once more with its own routing), e.g. "mismatch 3.1e-07/2.4e-03".
On a terminal, a live panel (rich) also shows the latest step, the best reward so far and the pace.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


class Progress:
    def __init__(self, metrics_path: Path, echo, live=None):
        self.path = metrics_path
        self.echo = echo
        self.live = live  # a rich.live.Live to refresh, or None (plain lines only)
        self.offset = 0
        self.partial = ""
        self.steps: dict[tuple[str, int], dict] = {}
        self.printed: set[int] = set()
        self.trained = 0  # trainer steps recorded, a step retrained after a trainer restart counted again
        self.started = time.monotonic()
        self.last: dict = {}
        self.evals: list[tuple[int, float]] = []

    def poll(self) -> None:
        try:
            with open(self.path) as f:
                f.seek(self.offset)
                chunk = f.read()
                self.offset = f.tell()
        except FileNotFoundError:
            return
        lines = (self.partial + chunk).split("\n")
        self.partial = lines.pop()
        evals = []
        for line in lines:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            self.steps.setdefault((row["role"], row["step"]), {})[row["name"]] = row["value"]
            if row["role"] == "trainer" and row["name"] == "loss":
                self.trained += 1
            if row["name"] == "eval_reward":
                evals.append((row["role"], row["step"]))
        for key in evals:
            values = self.steps[key]
            if values["eval_reward"] is not None:  # None: not finite (metrics.jsonl has no NaN)
                self.evals.append((key[1], values["eval_reward"]))
            self.echo(f"held-out eval reward {_num(values['eval_reward'], '.4f')} "
                      f"(policy version {_num(values.get('eval_policy_version', 0), '.0f')})")
        for (role, step), values in sorted(self.steps.items(), key=lambda kv: kv[0][1]):
            if role != "trainer" or step in self.printed or "loss" not in values:
                continue
            orch = self.steps.get(("orchestrator", step), {})
            if "reward_mean" not in orch:
                continue
            self.printed.add(step)
            self.last = {"step": step, **orch, **values}
            self.echo(
                f"step {step:4d} | reward {_num(orch['reward_mean'], '.3f')} | KL behaviour "
                f"{_kl(values, 'behaviour_kl')} mismatch {_kl(values, 'mismatch_kl')} | lag "
                f"{_num(orch.get('off_policy_lag', 0), '.0f')} | {_num(orch.get('tokens_per_s', 0), ',.0f')} tok/s | "
                f"sampled by v{_num(orch.get('policy_version', 0), '.0f')}")
        if self.live is not None:
            self.live.update(self.panel())

    def newest_trained_step(self) -> int:
        """The newest step the trainer finished (0: none yet)."""
        return max((s for (role, s), v in self.steps.items() if role == "trainer" and "loss" in v), default=0)

    def panel(self):
        from rich.table import Table

        table = Table(title="primebuild run", show_edge=False, expand=False)
        for column in ("step", "reward", "best eval", "KL behaviour", "KL mismatch", "lag", "tok/s",
                       "weights", "elapsed"):
            table.add_column(column, justify="right")
        last = self.last
        best = max((r for _, r in self.evals), default=None)
        table.add_row(
            str(last.get("step", "-")), _num(last.get("reward_mean"), ".3f"),
            _num(best, ".3f"), _kl(last, "behaviour_kl"),
            _kl(last, "mismatch_kl"), _num(last.get("off_policy_lag", 0), ".0f") if last else "-",
            _num(last.get("tokens_per_s", 0), ",.0f") if last else "-",
            "v" + _num(last.get("policy_version", 0), ".0f") if last else "-",
            f"{time.monotonic() - self.started:,.0f} s")
        return table


def _fmt(value: float | None) -> str:
    return _num(value, ".2e")


def _num(value: float | None, spec: str) -> str:
    """`value` formatted, "-" for None (a metric that was not finite, or not there)."""
    return "-" if value is None else format(value, spec)


def _kl(values: dict, name: str) -> str:
    """A KL, and after "/" the same without router replay where the trainer measured that."""
    replay_off = f"{name}_no_replay"
    if replay_off not in values:
        return _fmt(values.get(name))
    return f"{_fmt(values.get(name))}/{_fmt(values[replay_off])}"
