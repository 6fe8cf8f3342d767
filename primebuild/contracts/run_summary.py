"""What a run reports: the orchestrator's running record (`orchestrator.json`) and the run's summary
(`summary.json`), written by primebuild/runtime/report.py at the end of each session and read by `run`, `status`
and the tests. Fields missing from the file are None (a run that stopped before its last eval)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import Field

from primebuild.contracts.base import Contract, parse_contract
from primebuild.contracts.run_dir import write_json_atomic

S = TypeVar("S", bound="OrchestratorSummary")


class EngineInfo(Contract):
    name: Literal["embedded", "vllm"]
    version: str | None  # None: the server did not say


class OrchestratorSummary(Contract):
    """Written by the orchestrator: held-out rewards before RL and after its last step."""

    eval_reward_before: float | None = None
    eval_reward_after: float | None = None
    eval_reward_after_step: int | None = None  # the trained step whose weights the last eval used
    # A run of several environments: each one's held-out reward, by name (its id; id#index for a repeated id)
    eval_reward_before_by_env: dict[str, float] | None = None
    eval_reward_after_by_env: dict[str, float] | None = None
    inference_engine: EngineInfo | None = None
    orchestrator_seconds: float | None = None

    @classmethod
    def read(cls: type[S], path: Path) -> S:
        """The summary in `path`; an empty one when the file is not there (yet)."""
        if not path.is_file():
            return cls()
        from primebuild.json_file import read_json

        return parse_contract(cls, read_json(path, what="the run summary"), where=str(path))

    def write(self, path: Path) -> None:
        write_json_atomic(path, self.model_dump(mode="json", exclude_none=True))


class RunSummary(OrchestratorSummary):
    """The orchestrator's record, plus the session's outcome and the KL figures over the metrics."""

    sft: dict[str, Any] = Field(default_factory=dict)  # how the start model was built (the run record's model_info)
    model_seconds: float | None = None
    wall_seconds: float = 0.0  # summed over the run's sessions (a resume adds its own)
    outcome: str | None = None
    eval_reward_gain: float | None = None  # after - before
    eval_reward_gain_by_env: dict[str, float] | None = None  # after - before, per environment
    # Over every step where each was measured (primebuild/runtime/report.py); the *_no_replay ones and the routing
    # figures only exist in router-replay runs.
    mismatch_kl_max: float | None = None
    mismatch_kl_mean: float | None = None
    mismatch_kl_steps: int | None = None
    behaviour_kl_max: float | None = None
    behaviour_kl_mean: float | None = None
    behaviour_kl_steps: int | None = None
    mismatch_kl_no_replay_max: float | None = None
    mismatch_kl_no_replay_mean: float | None = None
    mismatch_kl_no_replay_steps: int | None = None
    behaviour_kl_no_replay_max: float | None = None
    behaviour_kl_no_replay_mean: float | None = None
    behaviour_kl_no_replay_steps: int | None = None
    routing_agreement_max: float | None = None
    routing_agreement_mean: float | None = None
    routing_agreement_steps: int | None = None
    routing_bytes_per_token_max: float | None = None
    routing_bytes_per_token_mean: float | None = None
    routing_bytes_per_token_steps: int | None = None
