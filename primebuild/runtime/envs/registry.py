"""Environment ids -> environments, as a manifest names them (`id`, `version`, `args`).

Built-in ids map to a class here. An id `verifiers:<taskset-id>` loads an installed `verifiers`
taskset package through verifiers' own loader and wraps it (see verifiers_adapter.py); `args` then
become that taskset's config fields.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from primebuild.contracts.environments import VERIFIERS_PREFIX
from primebuild.errors import UserError
from primebuild.runtime.envs.base import Environment
from primebuild.runtime.envs.long_tail import LongTailEnv
from primebuild.runtime.envs.reverse_text import ReverseTextEnv
from primebuild.runtime.envs.swe_tiny import SweTinyEnv
from primebuild.runtime.envs.tool_lookup import ToolLookupEnv
from primebuild.runtime.envs.wordle import WordleEnv

BUILTIN: dict[str, Callable[..., Environment]] = {
    ReverseTextEnv.id: ReverseTextEnv,
    WordleEnv.id: WordleEnv,
    SweTinyEnv.id: SweTinyEnv,
    LongTailEnv.id: LongTailEnv,
    ToolLookupEnv.id: ToolLookupEnv,
}


def known_environment_ids() -> list[str]:
    return sorted(BUILTIN) + [f"{VERIFIERS_PREFIX}<taskset-id>"]


def load_environment(
    env_id: str, version: str | None = None, args: Mapping[str, Any] | None = None
) -> Environment:
    """Build environment `env_id`; `version` (when given) must match what the code provides."""
    args = dict(args or {})
    if env_id.startswith(VERIFIERS_PREFIX):
        from primebuild.runtime.envs.verifiers_adapter import load_verifiers_environment

        env = load_verifiers_environment(env_id.removeprefix(VERIFIERS_PREFIX), args)
    elif env_id in BUILTIN:
        env = _construct(env_id, BUILTIN[env_id], args)
    else:
        raise UserError(
            f"unknown environment id {env_id!r}",
            hint=f"known environments: {', '.join(known_environment_ids())}",
        )
    if version is not None and str(version) != str(env.version):
        raise UserError(
            f"environment {env_id}: version {version!r} requested, but this primebuild provides "
            f"version {env.version!r}",
            hint=f"set the environment's version to {env.version!r} (and re-lock)",
        )
    return env


def _construct(env_id: str, factory: Callable[..., Environment], args: dict[str, Any]) -> Environment:
    accepted = [name for name in inspect.signature(factory).parameters if name != "self"]
    unknown = sorted(set(args) - set(accepted))
    if unknown:
        raise UserError(
            f"environment {env_id}: unknown args {unknown}",
            hint=f"accepted args: {', '.join(accepted) or '(none)'}",
        )
    return factory(**args)
