"""A trainer on a CPU turns torch.compile off before torchtitan is imported.

torchtitan's attention module compiles FlexAttention when it is imported (a class-level torch.compile), and
torch.compile imports inductor's compiler for it: ~0.8 s of CPU in every trainer process, for nothing on a
CPU, where the trainer runs DocumentAttention instead (titan_policy.load_titan_model) and compiles nothing.
With TORCHDYNAMO_DISABLE set, torch.compile hands the function back as it is. Only this process is changed:
a trainer starts no other program that compiles.
"""

from __future__ import annotations

import os

import torch


def off_unless_cuda(device: torch.device | str) -> None:
    """Call before the first import of primebuild/runtime/trainer/titan_*.py."""
    if torch.device(device).type != "cuda":
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
