"""Batch invariance for the embedded engine: a sequence's tokens and log-probs depend only on its own tokens
and the weights, never on which other sequences share its batch (`inference.batch_invariant`).

Why: with continuous batching, the sequences beside a request depend on arrival times. On the CPU the same
prompt alone and among 40 others gave fp32 log-probs up to 1e-6 apart (tiny model), and greedy decoding
flips wherever two candidates are that close: a held-out eval of one set of weights scored 0.3125 in one run
and 0.156 in the next (bench/bash_files.py, 32 tasks). An eval that moves by itself cannot show learning.

Where the differences come from, and what removes each (checked on MKL and oneDNN, torch 2.13):
- a matmul's row depends only on that row and the weight *for a fixed number of rows* (any position, any
  neighbours), but another row count can take another kernel or blocking: every matmul runs on blocks of
  ROW_BLOCK rows, the last one zero-padded (`in_row_blocks`);
- attention reduces over the batch's longest cache window, so a sequence's sums depend on its neighbours'
  lengths: decode attends one sequence at a time over its own length, and prefill runs one prompt at a time
  at its own length (model.py);
- norms, softmax, top-k and sampling already work row by row.

vLLM's `VLLM_BATCH_INVARIANT=1` is the same idea on GPUs (its own kernels); vLLM 0.32 has none for CPUs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ROW_BLOCK = 16  # rows per matmul call: one decode step of up to 16 sequences stays one call


def in_row_blocks(matmul: Callable[..., torch.Tensor], *operands: torch.Tensor) -> torch.Tensor:
    """matmul(*operands) computed on blocks of ROW_BLOCK rows (operands share their first axis), so that
    every call has the same number of rows whatever the batch; the result is cut back to the real rows."""
    rows = operands[0].shape[0]
    padded = -(-rows // ROW_BLOCK) * ROW_BLOCK
    if padded != rows:
        operands = tuple(F.pad(x, (0, 0) * (x.dim() - 1) + (0, padded - rows)) for x in operands)
    blocks = [matmul(*(x[start:start + ROW_BLOCK] for x in operands)) for start in range(0, padded, ROW_BLOCK)]
    return torch.cat(blocks)[:rows]
