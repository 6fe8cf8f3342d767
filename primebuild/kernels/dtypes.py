"""Dtype names as configs and plans write them -> torch dtypes: the one table trainer and inference share.
(Which dtype a precision computes in is torch-free: primebuild/contracts/dtypes.py.)"""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
