"""EnvSFTConfig and ChatSFTConfig: supervised warm-start training of a model on the RL trainer (read by
primebuild/runtime/trainer/env_sft.py and sft.py, launched by primebuild/runtime/sft.py).

Built purely from an `sft:` manifest by primebuild/builders/derivations.py. The output folder is not part of it:
the store hands the builder its staging folder, so the config — and the store key computed from it — is
the same on every machine.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from primebuild.contracts.base import Contract

# Where the reward "clicks" differs from seed to seed (measured on seeds 0-3: it first reaches 0.77
# between steps 100 and 124, rising ~0.07 per 5 steps there), so no fixed step count lands every seed
# in RL's band (~0.75-0.85): stopping on a validation reward does.
RL_START_REWARD = 0.77


class ChatSFTConfig(Contract):
    """SFT of a chat dataset on the RL trainer (primebuild/runtime/trainer/sft.py): torchtitan's model,
    FSDP2 over `ranks` torchrun ranks, chats packed as documents into `micro_batch_tokens` rows, the loss
    the mean NLL of assistant tokens. `{model_path}` and `{dataset_path}` are placeholders the store
    build resolves, so the config (and the store key) is the same on every machine; the dataset enters
    the key by its sha256."""

    kind: Literal["chat-sft"] = "chat-sft"
    model_path: str = "{model_path}"
    dataset_path: str = "{dataset_path}"
    dataset_sha256: str = ""
    steps: int = Field(100, ge=1)
    seed: int = 0
    lr: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(0, ge=0)
    batch_size: int = Field(16, ge=1)  # chats per optimizer step
    micro_batch_tokens: int = Field(2048, ge=1)
    max_grad_norm: float = Field(1.0, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    eval_rows: int = Field(0, ge=0)  # the dataset's last rows, held out: their loss every eval_every steps
    eval_every: int = Field(0, ge=0)
    ranks: int = Field(1, ge=1)
    device: Literal["cpu", "cuda"] = "cpu"
    logprob_chunk_tokens: int = Field(1024, ge=1)
    num_threads: int = Field(1, ge=1)  # per rank: bit-reproducible, and the machine stays usable
    # the environment whose held-out reward the finished model is scored on (greedy), as the env SFT does
    env_id: str | None = None
    env_version: str | None = None
    env_args: dict[str, Any] = Field(default_factory=dict)
    eval_n: int = Field(200, ge=0)


class EnvSFTConfig(Contract):
    """SFT of an environment's demonstrations on the RL trainer (primebuild/runtime/trainer/env_sft.py):
    each step `batch_size` fresh tasks with their demonstrations (`task.answer`, or a whole episode for a
    multi-turn environment), rendered as the orchestrator frames them, with the old loop's loss mask
    (model turns and their `<eos>` are targets, prompts and environment replies are given), packed as
    documents into rows of `micro_batch_tokens` over `ranks` FSDP2 ranks. The early stop is the old loop's:
    rank 0 greedy-decodes `validation_n` fixed training-side tasks every `check_every` steps from
    `min_steps` on and all ranks stop once their mean reward reaches `stop_at_reward`. `{model_path}` is
    the placeholder the store build resolves (the key is the same on every machine)."""

    kind: Literal["env-sft"] = "env-sft"
    model_path: str = "{model_path}"
    steps: int = Field(300, ge=1)
    seed: int = 0
    env_id: str = "reverse-text"
    env_version: str | None = None
    env_args: dict[str, Any] = Field(default_factory=dict)
    lr: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(50, ge=0)
    batch_size: int = Field(64, ge=1)  # tasks per optimizer step
    max_grad_norm: float = Field(1.0, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    micro_batch_tokens: int = Field(2048, ge=1)
    ranks: int = Field(1, ge=1)
    device: Literal["cpu", "cuda"] = "cpu"
    logprob_chunk_tokens: int = Field(1024, ge=1)
    num_threads: int = Field(1, ge=1)  # per rank: bit-reproducible, and the machine stays usable
    eval_n: int = Field(200, ge=0)  # the finished model's greedy held-out reward (0: skipped)
    eval_max_new_tokens: int = Field(16, ge=1)
    eval_every: int = Field(0, ge=0)  # > 0: also the held-out reward every that many steps (rank 0)
    stop_at_reward: float | None = Field(RL_START_REWARD, ge=0, le=1)
    check_every: int = Field(2, ge=1)
    min_steps: int = Field(60, ge=0)
    validation_n: int = Field(200, ge=1)
