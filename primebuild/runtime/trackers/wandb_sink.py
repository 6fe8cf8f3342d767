"""Weights & Biases sink: one wandb run per role (trainer, orchestrator), grouped by experiment name.

Keys are `<role>/<name>` at the step metrics.jsonl records. Offline mode writes the run under the run
folder's wandb/ (`wandb sync` uploads it later); online mode reads the API key from the environment
variable the manifest names as a secret, and nowhere else. Console capture and system-metrics sampling
are off: the supervisor already keeps every process's output in logs/, and a sampler thread per
process costs CPU the 2-core runs need.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from primebuild.contracts.run_dir import RunDir
from primebuild.contracts.trackers import WandbConfig


class WandbSink:
    def __init__(self, config: WandbConfig, run: RunDir, role: str):
        import wandb

        if config.api_key_env and config.api_key_env != "WANDB_API_KEY" and config.api_key_env in os.environ:
            os.environ["WANDB_API_KEY"] = os.environ[config.api_key_env]  # this process only
        run.wandb.mkdir(parents=True, exist_ok=True)
        self.role = role
        self.run = wandb.init(
            project=config.project, entity=config.entity, mode=config.mode, dir=str(run.wandb.parent),
            group=config.group, job_type=role, name=f"{run.root.name}-{role}", id=f"{run.root.name}-{role}",
            resume="allow", tags=list(config.tags),
            settings=wandb.Settings(console="off", x_disable_stats=True, disable_git=True, disable_code=True))

    def log(self, step: int, values: Mapping[str, float]) -> None:
        row = {f"{self.role}/{k}": float(v) for k, v in values.items() if math.isfinite(float(v))}
        if row:
            self.run.log(row, step=step)

    def close(self) -> None:
        self.run.finish()
