"""Group-relative advantages: each completion is scored against the other completions of its prompt.

A(i) = r(i) − mean(group), optionally divided by std(group) + eps (GRPO). The mean is a baseline that needs
no value model; the std division (GRPO) rescales every prompt to unit spread, which favours prompts that
are nearly solved or nearly failed — Dr. GRPO drops it, hence it is optional. std is the sample std
(n − 1 in the denominator, as TRL and verl use). A group whose rewards are all equal gets advantage 0:
it carries no learning signal.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np  # not torch: the orchestrator never loads it (bench/process_memory.py)


def group_relative_advantages(
    rewards: np.ndarray | Sequence[Sequence[float]], normalize_std: bool = False, eps: float = 1e-6
) -> np.ndarray:
    """``rewards`` is [num_groups, group_size]; returns advantages of the same shape (float32)."""
    r = np.asarray(rewards, dtype=np.float32)
    if r.ndim != 2:
        raise ValueError(f"rewards must be [num_groups, group_size], got shape {tuple(r.shape)}")
    adv = r - r.mean(axis=1, keepdims=True)
    if normalize_std:
        if r.shape[1] < 2:
            return np.zeros_like(r)  # one sample: no spread to normalise by
        adv = adv / (r.std(axis=1, ddof=1, keepdims=True) + np.float32(eps))
    return adv


def advantages_by_group(
    rewards: Sequence[float], group_ids: Sequence[object], normalize_std: bool = False, eps: float = 1e-6
) -> list[float]:
    """Same, for a flat list of samples whose groups may differ in size (e.g. after filtering)."""
    if len(rewards) != len(group_ids):
        raise ValueError(f"{len(rewards)} rewards for {len(group_ids)} group ids")
    members: dict[object, list[int]] = {}
    for i, g in enumerate(group_ids):
        members.setdefault(g, []).append(i)
    out = [0.0] * len(rewards)
    for idx in members.values():
        adv = group_relative_advantages([[rewards[i] for i in idx]], normalize_std, eps)[0]
        for i, a in zip(idx, adv.tolist(), strict=True):
            out[i] = a
    return out
