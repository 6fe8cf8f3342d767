"""TrackersConfig: the metric sinks a trainer or orchestrator feeds besides metrics.jsonl (primebuild/runtime/trackers/)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from primebuild.contracts.base import Contract


class WandbConfig(Contract):
    project: str
    entity: str | None = None
    mode: Literal["offline", "online"] = "offline"
    group: str  # the experiment's name: the trainer's and the orchestrator's runs side by side
    tags: list[str] = Field(default_factory=list)
    api_key_env: str | None = None  # the environment variable (a secret, passed by name) holding the key


class TensorboardConfig(Contract):
    flush_secs: int = Field(10, ge=1)


class TrackersConfig(Contract):
    wandb: WandbConfig | None = None
    tensorboard: TensorboardConfig | None = None
