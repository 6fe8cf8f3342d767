"""The rollout batch: what the orchestrator hands the trainer for one optimizer step.

Written by primebuild/runtime/orchestrator/main.py, read by primebuild/runtime/trainer/main.py; the file format (one
`rollouts/step_{k:06d}.safetensors` per step, written atomically, no pickle) is
primebuild/runtime/rollout_file.py, the packing into micro-batches primebuild/runtime/trainer/batch.py. These classes are
the records inside.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from primebuild.errors import UserError


class _Record(BaseModel):
    # Unknown keys are errors, as in every contract. Not frozen: the orchestrator fills in a sample's
    # advantage once its whole group is scored. `routed_experts` is an array: arbitrary types allowed.
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)


class Sample(_Record):
    """One rollout: a prompt and everything after it, as one token sequence.

    A single-turn rollout's completion is what the model sampled. A multi-turn rollout's completion is
    every model turn and every environment reply in order, exactly the tokens the model saw (token in,
    token out: nothing is re-tokenised); `completion_mask` is 1 on the model's tokens and 0 on the
    environment's, whose `inference_logprobs` are 0.0 placeholders that no loss reads.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    inference_logprobs: list[float]  # log-prob of each completion token under the sampling policy
    advantage: float
    reward: float
    # The oldest weights step that sampled any of its tokens (0 = base model): the sample's staleness,
    # which max_off_policy_steps bounds. A rollout may span weight updates; then later turns are newer.
    policy_version: int
    env_id: str = ""
    # 1 = train on this completion token, 0 = do not (environment and tool tokens of a multi-turn rollout).
    completion_mask: list[int] | None = None
    # The oldest weights step that sampled a token of each model turn, in order (one entry per turn).
    policy_versions: list[int] = Field(default_factory=list)
    # router replay: an integer array [num_tokens - 1, moe_layers, top_k] of expert ids (uint8 / uint16;
    # numpy as read from the file, a torch tensor is accepted too), see primebuild/runtime/rollout_file.py
    routed_experts: Any = None
    # On-policy distillation: the teacher's log-prob of each completion token, scored by the teacher's
    # server on the same token ids (0.0 placeholders where completion_mask is 0); None without a teacher.
    teacher_logprobs: list[float] | None = None

    def validate_shapes(self, where: str) -> None:
        if not self.prompt_ids:
            raise UserError(f"{where}: prompt_ids is empty; every sample needs at least one prompt token")
        n = len(self.completion_ids)
        if len(self.inference_logprobs) != n:
            raise UserError(
                f"{where}: {len(self.inference_logprobs)} inference_logprobs for {n} completion tokens",
                hint="send exactly one log-prob per sampled completion token",
            )
        if self.teacher_logprobs is not None and len(self.teacher_logprobs) != n:
            raise UserError(f"{where}: {len(self.teacher_logprobs)} teacher_logprobs for {n} completion tokens",
                            hint="the teacher scores exactly the sampled completion tokens")
        if self.completion_mask is not None and len(self.completion_mask) != n:
            raise UserError(
                f"{where}: completion_mask has {len(self.completion_mask)} entries for {n} tokens"
            )
        routes = self.routed_experts
        if routes is not None and (len(routes.shape) != 3 or routes.shape[0] != self.num_tokens - 1
                                   or "int" not in str(routes.dtype)):
            raise UserError(f"{where}: routed_experts {routes.dtype} {tuple(routes.shape)}: want integer "
                            f"[{self.num_tokens - 1} fed positions, moe_layers, top_k]")
        if self.policy_versions and min(self.policy_versions) != self.policy_version:
            raise UserError(f"{where}: policy_version {self.policy_version} is not the oldest of the turns' "
                            f"versions {self.policy_versions}")

    @property
    def num_turns(self) -> int:
        return max(1, len(self.policy_versions))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def num_loss_tokens(self) -> int:
        if self.completion_mask is None:
            return len(self.completion_ids)
        return int(sum(1 for m in self.completion_mask if m))


class RolloutBatch(_Record):
    """The samples of optimizer step `step` (1-based), and what the reader checks or resumes from."""

    step: int = Field(ge=1)
    samples: list[Sample]
    # The sampling temperature: the trainer refuses to score at another (its log-probs would not match).
    temperature: float | None = None
    # Where the orchestrator's group stream continues after this batch (it resumes from the last batch).
    next_group: int | None = None
