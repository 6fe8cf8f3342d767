"""The plan's `estimates` section: what the time models (primebuild/builders/timing.py, primebuild/builders/rollout_time.py)
predict for one RL step, and the lines `plan` prints about it.

The models return these types themselves, so the plan carries exactly what was computed."""

from __future__ import annotations

from typing import Literal

from pydantic import model_serializer

from primebuild.contracts.base import Contract


class WeightSyncEstimate(Contract):
    mode: str
    bytes: int  # size of one full set of weights in the sync dtype
    seconds: float
    write_seconds: float  # filesystem: trainer writes; broadcast: gathering onto trainer rank 0
    read_seconds: float  # filesystem: replicas read; broadcast: the broadcast itself


class StepTimes(Contract):
    """The roofline's worst case: every rollout full length."""

    prefill_seconds: float
    decode_seconds: float
    teacher_seconds: float = 0.0  # distillation: the teacher scoring a step's rollouts (its own GPUs)
    rollout_seconds: float  # prefill + decode (colocated) or the longer of the two (P/D split), + teacher
    train_seconds: float
    step_seconds: float  # max(rollout, train): the two sides overlap
    idle_side: Literal["trainer", "inference", "none"]  # trainer: waits for rollouts; inference: for the trainer
    idle_fraction: float  # share of the step the idle side waits
    decode_batch_per_replica: int
    decode_waves: int  # rounds of decoding when not all sequences fit in the KV cache at once
    decode_step_seconds: float
    tokens_per_step: int


class ProfileTimes(Contract):
    """The expected step from the manifest's rollout_profile (length and latency quantiles)."""

    expected_tokens: float  # of one rollout: prompt + completion + environment
    expected_rollout_seconds: float  # E[r] at the async decode batch
    tail_rollout_seconds: float  # r at the tail quantile, at the sync decode batch
    tail_quantile: float
    train_seconds: float
    sync_step_seconds: float
    async_step_seconds: float
    async_sync_ratio: float
    max_off_policy_steps: int  # m of the async estimate
    sync_trainer_idle: float
    sync_inference_idle: float
    async_trainer_idle: float
    async_inference_idle: float
    stale_fraction: float  # groups with a rollout longer than the staleness window (the async pool drops them)
    concurrency: int  # C


class SuggestedSplit(Contract):
    inference_nodes: int
    trainer_nodes: int
    step_seconds: float


class Estimates(Contract):
    summary: list[str]
    weight_sync: WeightSyncEstimate | None = None
    step: StepTimes | None = None  # None: no roofline estimate (a CPU run, an SFT build, an untimed layout)
    profile: ProfileTimes | None = None
    suggested_split: SuggestedSplit | None = None

    @model_serializer(mode="wrap")
    def _omit_what_was_not_estimated(self, handler):
        # A roofline estimate writes all its keys (profile and split as null when there is none); without
        # one, only what was estimated is written: the JSON (and the hashes) the plan had as a dict.
        data = handler(self)
        if self.step is None:
            return {k: v for k, v in data.items() if v is not None}
        return data

