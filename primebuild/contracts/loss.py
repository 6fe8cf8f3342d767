"""The RL losses' parameters: one class per loss, one name and one default per parameter.

The manifest's `orchestrator.loss` is this very union (primebuild/manifest/schema.py), the trainer's
config carries it unchanged, and primebuild/runtime/trainer/losses.py takes exactly these fields as the keyword
parameters of its function, so a parameter has the same name and the same default on every side.
Each loss has only its own parameters: `{name: grpo, kl_tau: 0.1}` is an unknown-field error, not a
value silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class _LossParams(BaseModel):
    # strict like a manifest section (validate_default, no inf/NaN), frozen like a contract
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)


class DppoKl(_LossParams):
    """DPPO with a KL penalty: tokens whose probability moved more than `mask_bound` are masked."""

    name: Literal["dppo-kl"] = "dppo-kl"
    mask_bound: float = Field(0.2, gt=0, description="Mask tokens whose probability gap exceeds this.")
    kl_tau: float = Field(1e-3, ge=0, description="Weight of the KL(inference || trainer) penalty.")


class Aipo(_LossParams):
    name: Literal["aipo"]
    is_cap: float = Field(2.0, gt=0, description="Importance-weight cap: a token's weight is min(r, is_cap).")


class Grpo(_LossParams):
    name: Literal["grpo"]
    clip_low: float = Field(0.2, ge=0, description="The ratio is clipped below at 1 - clip_low.")
    clip_high: float = Field(0.28, ge=0, description="The ratio is clipped above at 1 + clip_high.")


class Cispo(_LossParams):
    name: Literal["cispo"]
    clip_high: float = Field(2.0, gt=0, description="The importance weight is clipped above at 1 + clip_high.")


LossConfig = Annotated[DppoKl | Aipo | Grpo | Cispo, Field(discriminator="name")]
LOSS_NAMES = ("dppo-kl", "aipo", "grpo", "cispo")
LOSS_CLASSES: dict[str, type[_LossParams]] = {"dppo-kl": DppoKl, "aipo": Aipo, "grpo": Grpo, "cispo": Cispo}


def loss_params(loss: DppoKl | Aipo | Grpo | Cispo) -> dict[str, float]:
    """The loss function's keyword parameters."""
    return loss.model_dump(exclude={"name"})
