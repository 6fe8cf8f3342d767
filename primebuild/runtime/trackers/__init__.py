"""Metric sinks behind MetricsWriter: every value that goes to metrics.jsonl also goes to the trackers
the manifest names (one module per tracker). A sink's package is imported only when the manifest asks
for it, so runs without trackers never import wandb or tensorboard."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from primebuild.contracts.run_dir import RunDir
from primebuild.contracts.trackers import TrackersConfig
from primebuild.errors import UserError


class Sink(Protocol):
    def log(self, step: int, values: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def open_sinks(config: TrackersConfig, run: RunDir, role: str) -> list[Sink]:
    sinks: list[Sink] = []
    try:
        if config.wandb is not None:
            from primebuild.runtime.trackers.wandb_sink import WandbSink

            sinks.append(WandbSink(config.wandb, run, role))
        if config.tensorboard is not None:
            from primebuild.runtime.trackers.tensorboard_sink import TensorboardSink

            sinks.append(TensorboardSink(config.tensorboard, run, role))
    except ImportError as err:
        for sink in sinks:
            sink.close()
        raise UserError(f"the manifest's trackers need the {err.name} package, which is not installed here",
                        hint="pip install 'primebuild[trackers]' (and list `trackers` in image.extras)") from None
    return sinks
