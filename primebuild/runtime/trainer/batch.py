"""How the trainer cuts a rollout batch (its file: primebuild/runtime/rollout_file.py) into micro-batches.

Samples are packed as documents: each micro-batch is one row of at most ``micro_batch_tokens`` tokens
holding several samples back to back, each with its own positions (0, 1, ... from its first token), and
attention never crosses from one document into another (the positions restarting at 0 mark the
boundaries: transformers and torchtitan both derive the block-causal document mask from them). Nothing
is padded but the tail a context-parallel split needs. Micro-batches are balanced over ranks by token
count, and every rank gets the same number of them (FSDP collectives must match across ranks), topped up
with empty micro-batches whose loss weight is zero. The loss is normalised by a constant of the whole
step (see :func:`loss_normalizer`), never by anything that depends on the split, so 1 rank and N ranks
compute the same gradient.

With router replay a micro-batch carries the samples' ``routed_experts`` as [1, tokens, moe_layers,
top_k] int64, -1 where nothing was recorded (each document's last token and padding: the trainer's
router chooses there; no log-prob depends on them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from primebuild.contracts.rollout import Sample
from primebuild.errors import UserError


@dataclass
class MicroBatch:
    """One packed row. Position t of every per-token tensor describes token ``input_ids[:, t]``; its
    trainer log-prob comes from the logits at t-1 of the same document, so a document's first token
    never carries loss."""

    input_ids: torch.Tensor  # [1, T] long
    position_ids: torch.Tensor  # [1, T] long, 0 at each document's first token (and on padding)
    document_ids: torch.Tensor  # [1, T] long, index into sample_indices per token, -1 on padding
    loss_mask: torch.Tensor  # [1, T] bool, True on trained completion tokens
    inference_logprobs: torch.Tensor  # [1, T] float32
    advantages: torch.Tensor  # [1, T] float32
    sample_indices: list[int]  # documents -> index in the batch (empty for padding micro-batches)
    routed_experts: torch.Tensor | None = None  # [1, T, moe_layers, top_k] int64, -1 = not recorded
    # On-policy distillation (distill.py): [1, T] float32, the teacher's log-prob of each completion token;
    # NaN where the teacher scored nothing (prompts, padding, samples without one). None: no sample has one.
    teacher_logprobs: torch.Tensor | None = None

    @property
    def is_empty(self) -> bool:
        return not self.sample_indices

    @property
    def real_tokens(self) -> torch.Tensor:
        """[1, T] bool: True on the tokens of a document, False on padding."""
        return self.document_ids >= 0

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()


def _collate(samples: list[Sample], indices: list[int], pad_id: int) -> MicroBatch:
    width = sum(samples[i].num_tokens for i in indices)
    input_ids = torch.full((1, width), pad_id, dtype=torch.long)
    positions = torch.zeros((1, width), dtype=torch.long)
    documents = torch.full((1, width), -1, dtype=torch.long)
    loss_mask = torch.zeros((1, width), dtype=torch.bool)
    inf_lp = torch.zeros((1, width), dtype=torch.float32)
    adv = torch.zeros((1, width), dtype=torch.float32)
    start = 0
    for doc, i in enumerate(indices):
        s = samples[i]
        p, c = len(s.prompt_ids), len(s.completion_ids)
        span = slice(start, start + p + c)
        completion = slice(start + p, start + p + c)
        input_ids[0, span] = torch.tensor(s.prompt_ids + s.completion_ids, dtype=torch.long)
        positions[0, span] = torch.arange(p + c)
        documents[0, span] = doc
        mask = torch.ones(c, dtype=torch.bool)
        if s.completion_mask is not None:
            mask = torch.tensor(s.completion_mask, dtype=torch.bool)
        loss_mask[0, completion] = mask
        inf_lp[0, completion] = torch.tensor(s.inference_logprobs, dtype=torch.float32)
        adv[0, completion] = float(s.advantage)
        start += p + c
    return MicroBatch(input_ids, positions, documents, loss_mask, inf_lp, adv, list(indices),
                      _collate_routes(samples, indices, width), _collate_teacher(samples, indices, inf_lp))


def _collate_teacher(samples: list[Sample], indices: list[int], inf_lp: torch.Tensor) -> torch.Tensor | None:
    """The teacher's log-probs laid out like inference_logprobs, NaN where there is none."""
    if all(samples[i].teacher_logprobs is None for i in indices):
        return None
    out = torch.full_like(inf_lp, float("nan"))
    start = 0
    for i in indices:
        s = samples[i]
        p, c = len(s.prompt_ids), len(s.completion_ids)
        if s.teacher_logprobs is not None:
            out[0, start + p: start + p + c] = torch.tensor(s.teacher_logprobs, dtype=torch.float32)
        start += p + c
    return out


def _collate_routes(samples: list[Sample], indices: list[int], width: int) -> torch.Tensor | None:
    routes = [samples[i].routed_experts for i in indices]
    if all(r is None for r in routes):
        return None
    if any(r is None for r in routes):
        raise UserError("some samples of the batch carry routed_experts and some do not",
                        hint="router replay needs the routes of every sample")
    _, layers, top_k = routes[0].shape
    out = torch.full((1, width, layers, top_k), -1, dtype=torch.long)
    start = 0
    for i, r in zip(indices, routes, strict=True):
        if r.shape[1:] != (layers, top_k):
            raise UserError(f"routed_experts of shape {tuple(r.shape)} next to [..., {layers}, {top_k}]")
        out[0, start: start + r.shape[0]] = torch.as_tensor(r).long()
        start += samples[i].num_tokens
    return out


def pad_columns(mb: MicroBatch, width: int, pad_id: int) -> MicroBatch:
    """`mb` padded on the right to `width` columns (no document, no loss there): context parallelism
    splits a sequence into equal chunks."""
    extra = width - mb.input_ids.shape[1]
    if extra <= 0:
        return mb

    def pad(t: torch.Tensor, value) -> torch.Tensor:
        return torch.cat([t, torch.full((t.shape[0], extra, *t.shape[2:]), value, dtype=t.dtype)], dim=1)

    routes = None if mb.routed_experts is None else pad(mb.routed_experts, -1)  # -1: the router's own choice
    teacher = None if mb.teacher_logprobs is None else pad(mb.teacher_logprobs, float("nan"))
    return MicroBatch(pad(mb.input_ids, pad_id), pad(mb.position_ids, 0), pad(mb.document_ids, -1),
                      pad(mb.loss_mask, False), pad(mb.inference_logprobs, 0.0), pad(mb.advantages, 0.0),
                      mb.sample_indices, routes, teacher)


def empty_micro_batch(pad_id: int = 0) -> MicroBatch:
    """A two-token row with no loss: it still runs forward and backward, so its rank joins every FSDP
    collective, while contributing exactly zero gradient."""
    z = torch.zeros((1, 2), dtype=torch.float32)
    return MicroBatch(
        input_ids=torch.full((1, 2), pad_id, dtype=torch.long),
        position_ids=torch.arange(2).view(1, 2),
        document_ids=torch.full((1, 2), -1, dtype=torch.long),
        loss_mask=torch.zeros((1, 2), dtype=torch.bool),
        inference_logprobs=z,
        advantages=z.clone(),
        sample_indices=[],
    )


def pack(
    samples: list[Sample], micro_batch_tokens: int, world_size: int, pad_id: int = 0
) -> list[list[MicroBatch]]:
    """Pack ``samples`` as documents into micro-batches and deal them to ranks; returns one list per
    rank, all the same length. Deterministic: every rank computes the same plan from the same batch and
    takes its own share.

    First-fit decreasing: samples, longest first, go into the first micro-batch with room for them
    (at most ``micro_batch_tokens`` tokens in all); a sample longer than the budget gets a micro-batch
    of its own. Micro-batches then go to the least-loaded rank (by tokens), largest first.
    """
    if micro_batch_tokens <= 0:
        raise UserError(f"micro_batch_tokens must be positive, got {micro_batch_tokens}")
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    order = sorted(range(len(samples)), key=lambda i: (-samples[i].num_tokens, i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = samples[i].num_tokens
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(micro_batch_tokens - n)
    micro_batches = [_collate(samples, b, pad_id) for b in bins]

    per_rank: list[list[MicroBatch]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for mb in sorted(micro_batches, key=lambda m: -m.num_tokens):  # stable: ties keep creation order
        rank = min(range(world_size), key=lambda r: (load[r], len(per_rank[r]), r))
        per_rank[rank].append(mb)
        load[rank] += mb.num_tokens
    depth = max(1, max(len(r) for r in per_rank))
    for r in per_rank:
        r.extend(empty_micro_batch(pad_id) for _ in range(depth - len(r)))
    return per_rank


NormalizerKind = Literal["step_tokens", "samples_x_max_tokens"]


def loss_normalizer(samples: list[Sample], kind: NormalizerKind, max_completion_tokens: int | None) -> float:
    """The constant every micro-batch's loss sum is divided by; it depends on the whole step only.

    - ``step_tokens``: total trained completion tokens in the step (a token-level mean over the step, as
      in DAPO): every token weighs the same whatever the length of its completion.
    - ``samples_x_max_tokens``: number of samples × max completion length (Dr. GRPO's constant): the
      weight of a token does not even depend on the other samples' lengths.
    Neither divides a sample by its own length, which biases towards short answers (calibration.md).
    """
    if kind == "step_tokens":
        return float(max(1, sum(s.num_loss_tokens for s in samples)))
    if kind == "samples_x_max_tokens":
        if not max_completion_tokens:
            raise UserError(
                "loss_normalizer 'samples_x_max_tokens' needs max_completion_tokens",
                hint="set trainer max_completion_tokens",
            )
        return float(max(1, len(samples)) * int(max_completion_tokens))
    raise UserError(f"unknown loss_normalizer {kind!r}; use 'step_tokens' or 'samples_x_max_tokens'")
