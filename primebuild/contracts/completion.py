"""What the orchestrator reads from an inference server's `/v1/completions` answer.

Both engines must satisfy it (the embedded server natively, vLLM through its adapter), so the
orchestrator never knows which one it talks to. OpenAI's own fields beyond these are ignored.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SampledChoice(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    index: int = Field(ge=0)
    text: str
    finish_reason: str | None
    prompt_token_ids: list[int] = Field(min_length=1)
    token_ids: list[int]  # every sampled token, a final EOS included
    token_logprobs: list[float]  # log-prob of each sampled token under the sampling policy
    policy_version: int = Field(ge=0)  # the weights that produced the last token
    # base64 .npy [position, decoder_layer, k] when asked for (primebuild/kernels/routing.py decodes it)
    routed_experts: str | None = None
    # The weights the choice started on when it continued on newer ones (an update mid-generation);
    # None when one version produced every token.
    resumed_from_version: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _one_logprob_per_token(self) -> SampledChoice:
        if len(self.token_logprobs) != len(self.token_ids):
            raise ValueError(f"{len(self.token_logprobs)} log-probs for {len(self.token_ids)} tokens")
        return self

    @property
    def oldest_policy_version(self) -> int:
        """The oldest weights that sampled a token of this choice: what bounds its staleness."""
        if self.resumed_from_version is None:
            return self.policy_version
        return min(self.resumed_from_version, self.policy_version)


class CompletionResult(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    choices: list[SampledChoice] = Field(min_length=1)


# An embedded server whose weights are a mix of two policies (a broadcast update in place whose sender died
# after some pieces were installed: engine.py) answers completions with 503 and this error code, and /health
# with this status; it serves again once a whole update lands. The orchestrator re-routes and counts it down.
WEIGHTS_MIXED = "weights_mixed"
NO_WHOLE_POLICY = -1  # InferenceClient.version() of such a server: no policy version is whole there


class ServerHealth(BaseModel):
    """`GET /health`: the policy version being served, and (broadcast sync) the newest one staged. While
    `status` is WEIGHTS_MIXED, `policy_version` is the last whole one, no longer what the weights are."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    status: str = "ok"
    policy_version: int = Field(ge=0)
    received_version: int = Field(0, ge=0)
