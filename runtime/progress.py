"""The live progress line of a run, read from metrics.jsonl as the processes write it.

One line per trained step: reward of its rollouts, the trainer's KL to the sampling policy (behaviour:
numerics plus async staleness; mismatch: numerics alone, on samples drawn with the trained weights, "-"
when every sample is stale), off-policy lag, inference tokens/s and the policy version that sampled it.
"""

from __future__ import annotations

from pathlib import Path


class Progress:
    def __init__(self, metrics_path: Path, echo):
        self.path = metrics_path
        self.echo = echo
        self.offset = 0
        self.partial = ""
        self.steps: dict[tuple[str, int], dict] = {}
        self.printed: set[int] = set()

    def poll(self) -> None:
        import json

        try:
            with open(self.path) as f:
                f.seek(self.offset)
                chunk = f.read()
                self.offset = f.tell()
        except FileNotFoundError:
            return
        text = self.partial + chunk
        lines = text.split("\n")
        self.partial = lines.pop()
        evals = []
        for line in lines:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            self.steps.setdefault((row["role"], row["step"]), {})[row["name"]] = row["value"]
            if row["name"] == "eval_reward":
                evals.append((row["role"], row["step"]))
        for key in evals:
            values = self.steps[key]
            self.echo(f"held-out eval reward {values['eval_reward']:.4f} "
                      f"(policy version {values.get('eval_policy_version', '?'):.0f})")
        for (role, step), values in sorted(self.steps.items(), key=lambda kv: kv[0][1]):
            if role != "trainer" or step in self.printed or not any("loss" in k for k in values):
                continue
            orch = self.steps.get(("orchestrator", step), {})
            if "reward_mean" not in orch:
                continue
            self.printed.add(step)
            mismatch, behaviour = values.get("mismatch_kl"), values.get("behaviour_kl")
            self.echo(
                f"step {step:4d} | reward {orch['reward_mean']:.3f} | KL behaviour "
                f"{_fmt(behaviour)} mismatch {_fmt(mismatch)} | lag {orch.get('off_policy_lag', 0):.0f} | "
                f"{orch.get('tokens_per_s', 0):,.0f} tok/s | sampled by v{orch.get('policy_version', 0):.0f}")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"
