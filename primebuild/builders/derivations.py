"""Models as derivations, computed purely: what a manifest's model is built from, and its store key.

One constructor per builder turns (name, inputs) into a `Derivation`; its `key` is the store entry
that holds the output. `primebuild lock` records keys without building anything; the runtime
(primebuild/runtime/derivations.py) builds or reuses the entry under the same key. Nothing else computes a key.

- `init: random` -> builder random-init: the architecture facts, the tokenizer kind and the seed.
- an `sft:` manifest -> builder sft-env: the exact EnvSFTConfig the RL trainer's SFT reads (the
  environment's demonstrations), plus the store entry (or folder) of the model it starts from. A change
  to anything the SFT run reads rebuilds; editing a comment or the description does not. With
  `sft.dataset`, builder sft-chat: the ChatSFTConfig, the dataset entering by its sha256 (not its path:
  the key is the same on every machine).
- an `hf:` model's config files -> builder hf-configs: the repository, the commit and each file's sha256
  (`primebuild lock` fetches them, `plan` reads config.json back: primebuild/builders/hf_configs.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from primebuild.builders.model_ref import read_facts_json
from primebuild.builders.store import store_key
from primebuild.contracts.sft import ChatSFTConfig, EnvSFTConfig
from primebuild.errors import UserError
from primebuild.manifest.load import LoadedManifest

# Bump when what a builder writes changes: the store key must change with it.
RANDOM_INIT_BUILDER = "random-init/1"
SFT_ENV_BUILDER = "sft-env/1"  # the RL trainer's SFT of environment demonstrations (was sft/2: the one-process loop)
SFT_CHAT_BUILDER = "sft-chat/1"
DEFAULT_SFT_MICRO_BATCH_TOKENS = 2048
HF_CONFIGS_BUILDER = "hf-configs/1"


@dataclass(frozen=True)
class Derivation:
    name: str
    inputs: dict[str, Any]

    @property
    def key(self) -> str:
        return store_key(self.name, self.inputs)


def random_init(loaded: LoadedManifest) -> Derivation:
    m = loaded.manifest
    facts, _ = read_facts_json(loaded)  # (missing, unreadable or broken: an error located at model.facts)
    arch = {k: v for k, v in facts.items() if not k.startswith("_")}
    return Derivation(f"{m.name}-init", {"builder": RANDOM_INIT_BUILDER, "facts": arch, "tokenizer": m.model.tokenizer,
                                         "seed": m.seed})


def sft_config(loaded: LoadedManifest) -> EnvSFTConfig | ChatSFTConfig:
    """What the SFT run of an `sft:` manifest reads; it starts from the folder `{model_path}`."""
    m = loaded.manifest
    if m.sft is None:
        raise UserError(f"{loaded.path}: this manifest produces no model (it has no `sft:` section)",
                        hint="model.from_manifest must name a manifest with an `sft:` section")
    env = m.environments[0]
    version = None if env.version == "latest" else env.version
    if m.sft.dataset is not None:
        return chat_sft_config(loaded)
    # the stop check runs at the greedy evaluations' cadence when the manifest sets one (a long SFT whose
    # episodes are costly to decode checks every eval_every steps, not every 2)
    cadence = {"check_every": m.sft.eval_every} if m.sft.eval_every and m.sft.stop_at_reward is not None else {}
    return EnvSFTConfig(steps=m.sft.steps, seed=m.seed, env_id=env.id, env_version=version, env_args=dict(env.args),
                        lr=m.sft.lr, warmup_steps=m.sft.warmup_steps, batch_size=m.sft.batch_size,
                        stop_at_reward=m.sft.stop_at_reward, eval_every=m.sft.eval_every, ranks=m.sft.ranks, **cadence,
                        micro_batch_tokens=m.sft.micro_batch_tokens or DEFAULT_SFT_MICRO_BATCH_TOKENS,
                        device="cpu" if m.hardware.gpu == "cpu" else "cuda")


def dataset_file(loaded: LoadedManifest):
    """The chat dataset of `sft.dataset`, resolved against the manifest's folder."""
    return loaded.resolve(loaded.manifest.sft.dataset.path, ("sft", "dataset", "path"))


def chat_sft_config(loaded: LoadedManifest) -> ChatSFTConfig:
    """The RL trainer's SFT of `sft.dataset`. Every row is read and checked here, so `plan` names a bad
    row (file, line) before anything runs; the dataset enters the config by its sha256."""
    from primebuild.builders.chat_dataset import file_sha256, read_chats

    m = loaded.manifest
    path = dataset_file(loaded)
    if not path.is_file():
        raise UserError(loaded.source.problem(("sft", "dataset", "path"), f"{path}: " + ("not a file" if path.exists() else "no such file"),
                                              hint="sft.dataset.path is relative to this manifest"))
    read_chats(path)
    env = m.environments[0]
    return ChatSFTConfig(
        dataset_sha256=file_sha256(path), steps=m.sft.steps, seed=m.seed, lr=m.sft.lr,
        warmup_steps=m.sft.warmup_steps, batch_size=m.sft.batch_size,
        micro_batch_tokens=m.sft.micro_batch_tokens or DEFAULT_SFT_MICRO_BATCH_TOKENS,
        eval_rows=m.sft.dataset.eval_rows, eval_every=m.sft.eval_every, ranks=m.sft.ranks,
        device="cpu" if m.hardware.gpu == "cpu" else "cuda", env_id=env.id,
        env_version=None if env.version == "latest" else env.version, env_args=dict(env.args))


def sft(loaded: LoadedManifest, base: str) -> Derivation:
    """`base`: the store key of the model the SFT run starts from (or a folder outside the store)."""
    config = sft_config(loaded)
    builder = SFT_CHAT_BUILDER if isinstance(config, ChatSFTConfig) else SFT_ENV_BUILDER
    return Derivation(loaded.manifest.name, {"builder": builder, "config": config.model_dump(mode="json"),
                                             "base": base})


def hf_configs(repo: str, commit: str, digests: dict[str, str]) -> Derivation:
    """The store entry holding `repo`'s small config files at `commit`; `digests`: {file name: sha256}."""
    name = re.sub(r"[^A-Za-z0-9._+-]", "-", repo.replace("/", "--"))  # a store name has no "_" nor "/"
    return Derivation(f"{name}-configs", {"builder": HF_CONFIGS_BUILDER, "repo": repo, "commit": commit,
                                          "files": dict(sorted(digests.items()))})
