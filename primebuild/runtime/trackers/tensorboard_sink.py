"""TensorBoard sink: event files under the run folder's tensorboard/<role>/, one scalar per metric.

Scalars are written as double-precision tensors (`new_style`, `double_precision`): TensorBoard's reader
then gives back exactly the float metrics.jsonl holds, where the classic float32 summary would round it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from primebuild.contracts.run_dir import RunDir
from primebuild.contracts.trackers import TensorboardConfig


class TensorboardSink:
    def __init__(self, config: TensorboardConfig, run: RunDir, role: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run.tensorboard(role)), flush_secs=config.flush_secs)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            if math.isfinite(float(value)):
                self.writer.add_scalar(name, float(value), step, new_style=True, double_precision=True)

    def close(self) -> None:
        self.writer.close()
