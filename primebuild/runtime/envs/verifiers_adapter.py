"""Run a `verifiers` taskset (verifiers >= 0.4, the `verifiers.v1` API) as a primebuild Environment.

What verifiers 0.4 provides, and how it maps here:
- `vf.Taskset.load()` yields `vf.Task` objects; each wraps a frozen pydantic `vf.TaskData` (`prompt`,
  optional `system_prompt`, plus any fields a subclass adds, such as `answer`). Iterating a taskset sets
  each task's `idx`; `task.key` is a hash of the data (idx included, unless a taskset overrides it).
- Scoring is `await task.score(trace)`: it calls the task's `@vf.reward` (and `@vf.metric`) methods with
  the arguments they name (`task` = the TaskData, `trace` = a `vf.Trace`) and records the rewards on
  the trace; `trace.reward` is their weighted sum. Reward functions read the model's answer from the
  trace (`trace.last_reply`, `trace.messages`), so the adapter builds a minimal trace holding the
  prompt as a user message and the completion as a sampled assistant message. Rewards that need a
  sandbox runtime are skipped by verifiers itself when none is given.

Multi-turn: a taskset package that also exports a `vf.Env` subclass (verifiers' loader,
`vf.environment_class`) is a multi-turn environment. Its `run(task, agents)` plays the user through
`agents.<seat>.interaction(task).turn(message)`; primebuild's policy plays the one seat, every model turn
sampled by the orchestrator's own rollout loop (verifiers_multiturn.py says exactly what is and is not
driven). A package without an Env is single-turn and wrapped here; in both, verifiers' harness programs
are not used and a model turn is plain text, so a multi-turn Env with tools is refused when it loads.

Tool use: a single-agent taskset named with `args.harness` is played by that verifiers harness itself
(its chat program calls the task's MCP tools), against primebuild's chat interception, which records
every model turn token in / token out (verifiers_agents.py, chat_interception.py).

verifiers is imported lazily (it pulls in a large dependency tree: anthropic, mcp, math-verify...): a
run that never names a verifiers environment never imports it.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.metadata
import json
import random
import threading
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from primebuild.contracts.environments import VERIFIERS_PREFIX
from primebuild.errors import UserError
from primebuild.runtime.envs.base import Task, finite_reward

VERIFIERS_TASK = "verifiers_task"  # key in Task.info holding the wrapped vf.Task


def _import_verifiers():
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise UserError(
            f"verifiers environments need the `verifiers` package (import failed: {e})",
            hint="pip install verifiers==0.4.0",
        ) from e
    return vf


def _run_coroutine(coro):
    """Run `coro` to completion from sync code, even when this thread already runs an event loop
    (the orchestrator is async): then it runs on a short-lived thread with its own loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    result: dict[str, Any] = {}

    def target():
        try:
            result["value"] = asyncio.run(coro)
        except BaseException as e:  # re-raised in the caller's thread
            result["error"] = e

    thread = threading.Thread(target=target, name="verifiers-score")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def default_format_prompt(task: Task) -> str:
    """The taskset's prompt text, after its system prompt when it has one."""
    system = task.info.get("system_prompt")
    return f"{system}\n\n{task.prompt}" if system else task.prompt


class VerifiersEnvironment:
    """A bounded verifiers taskset split into a fixed held-out list and a training pool.

    The split is by content: tasks are ordered by a hash of `task.key` and the first `num_eval` form
    the eval list. It therefore does not depend on load order, and eval tasks never reach training.
    """

    def __init__(
        self,
        taskset: Any,
        *,
        env_id: str | None = None,
        version: str | None = None,
        num_eval: int = 200,
        format_prompt: Callable[[Task], str] = default_format_prompt,
    ):
        vf = _import_verifiers()
        if not isinstance(taskset, vf.Taskset):
            raise TypeError(f"expected a verifiers.v1.Taskset, got {type(taskset).__name__}")
        name = getattr(taskset.config, "id", "") or type(taskset).__name__
        if not taskset.bounded:
            raise UserError(
                f"verifiers taskset {name}: it yields tasks forever, so no fixed eval split exists",
                hint="bound it first, e.g. taskset.take(10_000)",
            )
        self.id = env_id or f"verifiers:{name}"
        self.version = version if version is not None else f"verifiers-{vf_version()}"
        self._format_prompt = format_prompt

        # One entry per content: a duplicated row must not land on both sides of the split.
        unique = {}
        for vf_task in taskset:
            unique.setdefault(content_key(vf_task), vf_task)
        tasks = sorted((self._wrap(t) for t in unique.values()), key=lambda t: t.info["content_key"])
        if len(tasks) <= num_eval:
            raise UserError(
                f"verifiers taskset {name}: {len(tasks)} tasks cannot hold {num_eval} eval tasks "
                "and still leave some for training",
                hint=f"lower num_eval (at least 1), or give the taskset at least {num_eval + 1} distinct tasks"
                if num_eval > 1 else "give the taskset at least 2 distinct tasks (one held out, one to train on)",
            )
        self._eval, self._train = tasks[:num_eval], tasks[num_eval:]

    @staticmethod
    def _wrap(vf_task: Any) -> Task:
        data = vf_task.data
        answer = getattr(data, "answer", None)
        return Task(
            prompt=data.prompt_text,
            answer="" if answer is None else str(answer),
            info=MappingProxyType(
                {
                    VERIFIERS_TASK: vf_task,
                    "content_key": content_key(vf_task),
                    "system_prompt": data.system_prompt,
                }
            ),
        )

    def sample_tasks(self, rng: random.Random, n: int) -> list[Task]:
        return [rng.choice(self._train) for _ in range(n)]

    def eval_tasks(self) -> list[Task]:
        return list(self._eval)

    def format_prompt(self, task: Task) -> str:
        return self._format_prompt(task)

    async def ascore(self, task: Task, completion: str) -> float:
        vf = _import_verifiers()
        from verifiers.v1.graph import MessageNode
        from verifiers.v1.trace import TraceTask

        vf_task = task.info[VERIFIERS_TASK]
        prompt_nodes = []
        if task.info.get("system_prompt"):
            prompt_nodes.append(MessageNode(message=vf.SystemMessage(content=task.info["system_prompt"])))
        prompt_nodes.append(
            MessageNode(
                parent=len(prompt_nodes) - 1 if prompt_nodes else None,
                message=vf.UserMessage(content=task.prompt),
            )
        )
        reply = MessageNode(
            parent=len(prompt_nodes) - 1, message=vf.AssistantMessage(content=completion), sampled=True
        )
        trace = vf.Trace(
            task=TraceTask(
                type=type(vf_task).__name__, data=vf_task.data, key=vf_task.key, hash=vf_task.hash
            ),
            agent=vf.AgentInfo(config=vf.AgentConfig(), name="primebuild", trainable=False),
            nodes=[*prompt_nodes, reply],
        )
        await vf_task.score(trace)
        return finite_reward(self.id, trace.reward)

    def score(self, task: Task, completion: str) -> float:
        return _run_coroutine(self.ascore(task, completion))


def content_key(vf_task: Any) -> str:
    """A hash of the task's data without `idx`. verifiers' own `task.key` hashes `idx` too (its
    position in `load()`), which would make the split depend on load order."""
    data = vf_task.data.model_dump(mode="json", exclude_none=True, exclude={"idx"})
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def vf_version() -> str:
    try:
        return importlib.metadata.version("verifiers")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


MULTI_TURN_ARGS = ("max_turns", "prompt_format", "reply_format", "env")  # the multi-turn adapter's own args


def load_verifiers_environment(taskset_id: str, args: Mapping[str, Any]) -> VerifiersEnvironment:
    """Load installed taskset package `taskset_id` with verifiers' loader. A package that exports a
    `vf.Env` subclass is multi-turn (verifiers_multiturn.py); else it is wrapped single-turn. `args` are
    the taskset's config fields, except `num_eval` (the held-out size) and, multi-turn only,
    MULTI_TURN_ARGS (`env`: the Env's own config fields). With `harness` (and optionally `max_turns`), a
    single-agent taskset is played by that verifiers harness, its tools included (verifiers_agents.py)."""
    vf = _import_verifiers()
    from pydantic import ValidationError

    args = dict(args)
    num_eval = args.pop("num_eval", 200)
    adapter_args = {name: args.pop(name) for name in MULTI_TURN_ARGS if name in args}
    env_id = f"{VERIFIERS_PREFIX}{taskset_id}"
    try:
        config_type = vf.taskset_config_type(taskset_id)
        env_class = vf.environment_class(taskset_id)
    except (ModuleNotFoundError, TypeError, AttributeError, ValueError) as e:
        raise UserError(
            f"verifiers taskset {taskset_id!r} could not be loaded: {e}",
            hint="install the taskset's package into the run's environment",
        ) from e
    if env_class is vf.SingleAgentEnv and "harness" in args:  # played by verifiers' harness, tools included
        from primebuild.contracts.environments import BASH_SANDBOX_LIMITS
        from primebuild.runtime.envs.verifiers_agents import VerifiersAgentEnvironment

        harness = args.pop("harness")
        limits = {name: args.pop(name) for name in BASH_SANDBOX_LIMITS if name in args}
        unknown = sorted(set(adapter_args) - {"max_turns"})
        if unknown:
            raise UserError(f"environment {env_id}: {unknown} apply to primebuild-driven multi-turn environments, "
                            "not to one played by a verifiers harness (args: harness, max_turns, num_eval; bash: "
                            "cpu_seconds, memory_mb, command_seconds, wall_seconds)")
        try:
            config = config_type.model_validate({**args, "id": taskset_id})
        except ValidationError as e:
            raise UserError(f"verifiers taskset {taskset_id!r}: invalid args: {e}") from e
        return VerifiersAgentEnvironment(vf.load_taskset(config), env_id=env_id, version=_package_version(taskset_id),
                                         num_eval=num_eval, harness=harness, **adapter_args, **limits)
    if env_class is vf.SingleAgentEnv:
        if adapter_args:
            raise UserError(f"environment {env_id}: {sorted(adapter_args)} apply to multi-turn environments only, "
                            f"and package {taskset_id!r} exports no verifiers Env (it is single-turn)")
        try:
            config = config_type.model_validate({**args, "id": taskset_id})
        except ValidationError as e:
            raise UserError(f"verifiers taskset {taskset_id!r}: invalid args: {e}") from e
        return VerifiersEnvironment(vf.load_taskset(config), env_id=env_id, version=_package_version(taskset_id),
                                    num_eval=num_eval)

    from primebuild.runtime.envs.verifiers_multiturn import VerifiersMultiTurnEnvironment

    env_fields = adapter_args.pop("env", None) or {}
    if not isinstance(env_fields, Mapping):
        raise UserError(f"environment {env_id}: args.env must be a mapping of the Env's config fields")
    try:
        config = vf.resolve_env_config({**env_fields, "taskset": {**args, "id": taskset_id}})
    except ValidationError as e:
        raise UserError(f"verifiers environment {taskset_id!r}: invalid args: {e}") from e
    try:
        vf_env = vf.load_environment(config)
    except (TypeError, ValueError) as e:
        raise UserError(f"verifiers environment {taskset_id!r} could not be built: {e}") from e
    return VerifiersMultiTurnEnvironment(vf_env, env_id=env_id, version=_package_version(taskset_id),
                                         num_eval=num_eval, **adapter_args)


def _package_version(taskset_id: str) -> str:
    """The installed distribution's version for a taskset id (verifiers' own naming rules)."""
    name = taskset_id.rsplit("/", 1)[-1].split("@", 1)[0]
    for candidate in (name, name.replace("_", "-"), name.replace("-", "_")):
        try:
            return importlib.metadata.version(candidate)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unversioned"
