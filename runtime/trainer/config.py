"""TrainerConfig: everything one trainer process needs; the plan renders it to JSON (``--config``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from primebuild.errors import Problem, UserError


class TrainerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_path: str  # HF folder (config.json, safetensors, tokenizer files)
    run_dir: str  # holds rollouts/, weights/, checkpoints/, metrics.jsonl, STOP

    # Objective
    loss: str = "dppo-kl"  # a key of losses.LOSSES
    loss_params: dict[str, float] = Field(default_factory=dict)
    loss_normalizer: Literal["step_tokens", "samples_x_max_tokens"] = "step_tokens"
    max_completion_tokens: int | None = None  # for samples_x_max_tokens (else batch metadata)
    temperature: float = Field(1.0, gt=0)  # sampling temperature: logits are divided by it

    # Optimisation
    optimizer: Literal["adamw"] = "adamw"
    lr: float = Field(1e-6, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    warmup_steps: int = Field(0, ge=0)  # linear warm-up: step k uses lr * min(1, k / warmup_steps)
    max_steps: int = Field(..., ge=1)
    seed: int = 0

    # Execution
    micro_batch_tokens: int = Field(8192, ge=1)  # padded tokens (rows × longest row) per forward
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype; master weights and Adam stay fp32
    activation_checkpointing: bool = False
    pad_token_id: int = 0  # any id works: padded positions are masked out of attention and loss

    # Rollout intake
    rollout_timeout_s: float = Field(3600.0, gt=0)  # give up when step k's batch does not arrive
    poll_interval_s: float = Field(0.2, gt=0)

    # Weights out
    weight_sync: Literal["filesystem", "broadcast"] = "filesystem"
    keep_weights: int | None = Field(None, ge=1)  # keep only the newest N weight folders
    broadcast_init_method: str | None = None  # tcp://HOST:PORT, hosted by trainer rank 0
    broadcast_world_size: int | None = Field(None, ge=2)  # 1 sender + inference receivers
    broadcast_timeout_s: float = 600.0

    # Checkpoints
    checkpoint_every: int = Field(0, ge=0)  # 0 = only at the end of the run
    keep_checkpoints: int | None = Field(None, ge=1)
    resume: bool = False  # continue from the newest stable checkpoint in run_dir/checkpoints

    @model_validator(mode="after")
    def _broadcast_needs_wiring(self) -> TrainerConfig:
        if self.weight_sync == "broadcast" and (
            not self.broadcast_init_method or not self.broadcast_world_size
        ):
            raise ValueError("weight_sync 'broadcast' needs broadcast_init_method and broadcast_world_size")
        return self

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir)


def load_config(path: str | Path) -> TrainerConfig:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise UserError(f"{path}: trainer config not found") from e
    except json.JSONDecodeError as e:
        raise UserError(
            Problem(f"not valid JSON: {e.msg}", file=str(path), line=e.lineno, column=e.colno)
        ) from e
    try:
        return TrainerConfig.model_validate(data)
    except ValidationError as e:
        raise UserError(
            [
                Problem(err["msg"], file=str(path), field=".".join(str(x) for x in err["loc"]) or None)
                for err in e.errors()
            ]
        ) from e
