"""The dtype a precision computes in, by name: the plan compiler and the processes read the same table."""

from __future__ import annotations

# fp8 has no entry: FP8 matmuls run inside a wider dtype, which each side chooses (bf16 on GPUs).
PRECISION_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
