"""A multi-turn verifiers (0.4) environment, its turns sampled by primebuild's own rollout loop.

In verifiers 0.4 a multi-turn environment is an `vf.Env` subclass that a taskset package exports next
to its `Taskset`: its `run(task, agents)` plays the user, opening `agents.<seat>.interaction(task)` and
calling `turn(message)` once per user message; each turn returns a `Segment` holding the model's reply
(or `terminated` when a limit ended the exchange). verifiers itself runs each turn as a segment of a
harness program behind an HTTP interception server; here the seat is primebuild's policy instead:

- `VerifiersMultiTurnEnvironment.start(task)` gives an `Episode` whose first `step` starts the
  Env's own `setup` and `run` on the orchestrator's event loop, with an `Agents` whose only seat is
  `PolicySeat` (made through verifiers' `Agents(config, make)`).
- `turn(message)` hands the message to the rollout loop (it becomes the environment's tokens, framed by
  `reply_format`, masked out of the loss) and waits for the next model turn, which the orchestrator
  samples token in / token out (log-probs and policy version recorded per turn, primebuild/runtime/envs/transcript.py).
- When the rollout loop stops first (the turn budget, seq_len), the pending `turn` returns a
  `terminated` segment, as a verifiers limit would, and `run` finishes on its own. A task's `@vf.stop`
  on the trace is checked before each model turn after the first, as verifiers does; when one fires the
  turn comes back `terminated` and the episode ends.
- Leaving the interaction scores its trace with the task's own `@vf.reward`/`@vf.metric` methods
  (`Task.score`, no runtime: rewards that need one are skipped by verifiers); then the Env's `finalize`
  sees the episode. The episode's reward is `trace.reward`. An exception in `run` or `finalize` ends
  the rollout with a located error.

Refused when the environment loads, with the reason, rather than silently not applied: tool use (a task
or taskset with MCP `toolsets`: verifiers runs those tools inside its harness programs), `@vf.stop`s and
`@vf.intercept`s on requests or responses (verifiers' message dialects, not used here: a model turn is
plain text), more than one agent seat (e.g. user-sim, whose user is a second model), token limits on
the seat (the orchestrator's seq_len bounds an episode), and tasks without a prompt (the user opens).
At run time a second interaction in one episode is an error (one rollout is one token sequence). The
seat's harness, runtime, model and sampling settings are not used: the orchestrator samples.

Manifest args (besides the taskset's config fields): `num_eval`, `max_turns` (default 8, or the seat's
own smaller `max_turns`), `prompt_format` ("{prompt}" by default; the task's system prompt and prompt),
`reply_format` ("\n{message}\n": how an Env message is framed as environment tokens; write the model's
chat framing here), `env` (the Env's own config fields).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from primebuild.errors import UserError
from primebuild.runtime.envs.base import Task
from primebuild.runtime.envs.verifiers_adapter import VERIFIERS_TASK, VerifiersEnvironment, _import_verifiers

_TERMINATE = object()  # to the Env: the rollout loop stopped the exchange (a budget), no more model turns
_END = object()  # to the rollout loop: the Env's run() returned, the episode is over


class VerifiersMultiTurnEnvironment(VerifiersEnvironment):
    """A verifiers `Env` with one agent seat, played by the policy; see the module docstring."""

    def __init__(self, vf_env: Any, *, env_id: str, version: str, num_eval: int = 200, max_turns: int = 8,
                 prompt_format: str = "{prompt}", reply_format: str = "\n{message}\n"):
        for name, value, field in (("prompt_format", prompt_format, "{prompt}"),
                                   ("reply_format", reply_format, "{message}")):
            if not isinstance(value, str) or field not in value:
                raise UserError(f"environment {env_id}: {name} must be a string holding {field}, got {value!r}")
        if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
            raise UserError(f"environment {env_id}: max_turns must be a positive integer, got {max_turns!r}")
        seats = _agent_seats(vf_env.config)
        if len(seats) != 1:
            raise UserError(f"environment {env_id}: {type(vf_env).__name__} declares {len(seats)} agent seats "
                            f"({', '.join(seats)}); primebuild plays exactly one, with the policy",
                            hint="use an Env with one AgentConfig field (the policy's seat)")
        ((self.seat, seat_config),) = seats.items()
        token_limits = [f for f in ("max_input_tokens", "max_output_tokens", "max_total_tokens")
                        if getattr(seat_config, f, None) is not None]
        if token_limits:
            raise UserError(f"environment {env_id}: the {self.seat} seat sets {', '.join(token_limits)}, which "
                            "this adapter does not count", hint="bound episodes with orchestrator.seq_len instead")
        super().__init__(vf_env.taskset, env_id=env_id, version=version, num_eval=num_eval)
        # one task per Task class: hooks and toolsets are the class's (and the config's), not the data's
        for vf_task in {type(t.info[VERIFIERS_TASK]): t.info[VERIFIERS_TASK] for t in self._eval + self._train}.values():
            _refuse_tools(vf_env.taskset, vf_task, env_id)
            _refuse_message_hooks(vf_task, env_id)
        unprompted = [t for t in self._eval + self._train if t.info[VERIFIERS_TASK].data.prompt is None]
        if unprompted:
            raise UserError(f"environment {env_id}: {len(unprompted)} tasks have no prompt (the user opens the "
                            "exchange); primebuild's rollout loop starts every episode with a model turn",
                            hint="give every task a prompt")
        self.vf_env = vf_env
        # the seat's own turn limit, when it sets one, is a verifiers limit too
        self.max_turns = min(max_turns, seat_config.max_turns or max_turns)
        self.prompt_format, self.reply_format = prompt_format, reply_format

    def format_prompt(self, task: Task) -> str:
        return self.prompt_format.replace("{prompt}", super().format_prompt(task))

    def start(self, task: Task) -> VerifiersEpisode:
        return VerifiersEpisode(self, task.info[VERIFIERS_TASK])

    def demonstration(self, task: Task, rng) -> list[tuple[bool, str]]:
        raise UserError(f"environment {self.id}: a verifiers Env has no demonstrations to imitate",
                        hint="start RL from a model that already plays it (no sft section for this environment)")


class VerifiersEpisode:
    """One run of the Env: its `run()` on a task of its own, meeting the rollout loop through two queues."""

    def __init__(self, env: VerifiersMultiTurnEnvironment, vf_task: Any):
        self.env, self.vf_task = env, vf_task
        self.to_env: asyncio.Queue = asyncio.Queue()  # model turns' text, or _TERMINATE
        self.to_model: asyncio.Queue = asyncio.Queue()  # the Env's user messages, then _END or its exception
        self.runner: asyncio.Task | None = None
        self.seat: PolicySeat | None = None

    async def step(self, completion: str) -> str | None:
        if self.runner is None:
            self.runner = asyncio.create_task(self._play(), name=f"{self.env.id} run()")
        await self.to_env.put(completion)
        return self._reply(await self.to_model.get())

    def _reply(self, item: Any) -> str | None:
        if item is _END:
            return None
        if isinstance(item, BaseException):
            raise item
        return self.env.reply_format.replace("{message}", item)

    async def _play(self) -> None:
        vf = _import_verifiers()
        vf_env = self.env.vf_env
        try:
            self.seat = None
            agents = vf.Agents(vf_env.config, make=self._make_seat)
            async with asyncio.timeout(vf_env.config.timeout.episode):
                await vf_env.setup(agents)
                if not getattr(agents, self.env.seat).trainable:
                    raise RuntimeError(f"setup() marks the {self.env.seat} seat untrainable, but the policy plays it")
                await vf_env.run(self.vf_task, agents)
            if self.seat is None or self.seat.trace is None:
                raise RuntimeError(f"{type(vf_env).__name__}.run() never let the policy play")
            episode = vf.Episode(env=vf.EnvInfo(id=vf_env.config.env_id), task=self.seat.trace.task,
                                 traces=[self.seat.trace])
            async with asyncio.timeout(vf_env.config.timeout.finalize):
                await vf_env.finalize(self.vf_task, episode)
        except Exception as e:  # handed to the rollout loop, raised from step() or reward()
            await self.to_model.put(RuntimeError(f"environment {self.env.id}: {type(e).__name__}: {e}"))
            return
        await self.to_model.put(_END)

    def _make_seat(self, name: str, spec: Any) -> PolicySeat:
        self.seat = PolicySeat(name, spec, self)
        return self.seat

    async def reward(self) -> float:
        if self.runner is None:
            raise RuntimeError("reward() before any step()")
        if not self.runner.done():  # the rollout loop stopped first: the pending turn comes back terminated
            await self.to_env.put(_TERMINATE)
        await self.runner  # it hands its failure to the queue instead of raising
        while not self.to_model.empty():
            item = self.to_model.get_nowait()
            if isinstance(item, BaseException):
                raise item
        return float(self.seat.trace.reward)

    async def close(self) -> None:
        if self.runner is not None and not self.runner.done():
            self.runner.cancel()
            with contextlib.suppress(BaseException):
                await self.runner


class PolicySeat:
    """The Env's one agent seat, played by the policy (what verifiers' own Agent does with a harness)."""

    def __init__(self, name: str, config: Any, episode: VerifiersEpisode):
        self.name, self.config, self.episode = name, config, episode
        self.trainable = True  # an Env's setup() may clear it: an error, since the policy plays (and trains) it
        self.trace = None
        self.turns = 0
        self.over = False

    @contextlib.asynccontextmanager
    async def interaction(self, task: Any, **_: Any) -> AsyncIterator[PolicyInteraction]:
        if self.trace is not None:
            raise RuntimeError("primebuild plays one interaction per episode (one token sequence)")
        self.trace = _open_trace(task, self.name)
        interaction = PolicyInteraction(self, task)
        try:
            yield interaction
        except BaseException:  # the run failed or was cancelled: nothing to score
            interaction.closed = True
            raise
        await interaction.close()

    async def run(self, task: Any, **_: Any) -> Any:
        """One segment on a prompted task (verifiers' `agent.run`): the policy's first turn."""
        async with self.interaction(task) as single:
            await single.turn()
        return self.trace


class PolicyInteraction:
    """`Interaction.turn` and `.trace`, as verifiers defines them, over the rollout loop's turns."""

    def __init__(self, seat: PolicySeat, task: Any):
        self.seat, self.task = seat, task
        self.closed = False

    @property
    def trace(self) -> Any:
        return self.seat.trace

    async def turn(self, message: Any = None) -> Any:
        vf = _import_verifiers()
        from verifiers.v1.types import content_text

        seat, episode = self.seat, self.seat.episode
        if self.closed:
            raise RuntimeError("this interaction is closed")
        if seat.over:
            raise RuntimeError("the exchange is over (the run ended); read interaction.trace")
        if seat.turns == 0 and message is not None:
            raise ValueError("the task's prompt opens this exchange: take its first reply with a bare turn()")
        if seat.turns > 0 and message is None:
            raise ValueError("this exchange takes its next user message")
        if message is not None:
            if (stopped := await _trace_stop(self.task, self.trace)) is not None:
                seat.over = True  # a @vf.stop ends the exchange before the next model turn; the message goes unsent
                self.trace.stop(stopped)
                return vf.Segment(messages=[], terminated=True)
            text = message if isinstance(message, str) else "\n".join(
                content_text(m["content"] if isinstance(m, dict) else m.content) for m in message)
            _append(self.trace, vf.UserMessage(content=text))
            await episode.to_model.put(text)
        completion = await episode.to_env.get()
        if completion is _TERMINATE:
            seat.over = True
            self.trace.stop("max_turns" if seat.turns >= episode.env.max_turns else "max_total_tokens")
            return vf.Segment(messages=[], terminated=True)
        reply = vf.AssistantMessage(content=completion)
        _append(self.trace, reply, sampled=True)
        seat.turns += 1
        return vf.Segment(messages=[reply])

    async def close(self) -> Any:
        """Leaving the interaction ends the exchange and scores it with the task's own rewards."""
        if not self.closed:
            self.closed = True
            self.trace.stop("user_closed")
            await self.task.score(self.trace)
        return self.trace


def _open_trace(vf_task: Any, seat: str) -> Any:
    vf = _import_verifiers()
    from verifiers.v1.trace import TraceTask

    data = vf_task.data
    trace = vf.Trace(task=TraceTask(type=type(vf_task).__name__, data=data, key=vf_task.key, hash=vf_task.hash),
                     agent=vf.AgentInfo(config=vf.AgentConfig(), name=seat, trainable=True), nodes=[])
    if data.system_prompt:
        _append(trace, vf.SystemMessage(content=data.system_prompt))
    _append(trace, vf.UserMessage(content=data.prompt_text))
    return trace


def _append(trace: Any, message: Any, sampled: bool = False) -> None:
    from verifiers.v1.graph import MessageNode

    parent = len(trace.nodes) - 1 if trace.nodes else None
    trace.nodes.append(MessageNode(parent=parent, message=message, sampled=sampled))


def _agent_seats(config: Any) -> dict[str, Any]:
    from verifiers.v1.configs.agent import agent_config_fields

    return agent_config_fields(config)


def _refuse_tools(taskset: Any, vf_task: Any, env_id: str) -> None:
    tools = [*type(vf_task).toolsets(vf_task.config), *taskset.toolsets(taskset.config)]
    if tools:
        raise UserError(f"environment {env_id}: its tasks use tools ({', '.join(type(t).__name__ for t in tools)}); "
                        "verifiers runs MCP toolsets inside its harness programs, which primebuild's rollout loop "
                        "does not drive", hint="a multi-turn Env without toolsets loads; tool use does not yet")


def _stops_by_boundary(vf_task: Any) -> tuple[list, list]:
    """The task's `@vf.stop`s (decorated or plugged through its config): (on the trace, on a request or response)."""
    from verifiers.v1.session import hook_boundary
    from verifiers.v1.trace import Trace

    on_trace, on_messages = [], []
    for fn in vf_task.hooks("stop"):
        (on_trace if hook_boundary(fn, allow_trace=True) is Trace else on_messages).append(fn)
    return on_trace, on_messages


async def _trace_stop(vf_task: Any, trace: Any) -> str | None:
    """The name of the first trace `@vf.stop` that fires, checked before each model turn as verifiers does."""
    from verifiers.v1.session import call_hook
    from verifiers.v1.trace import Trace

    for fn in _stops_by_boundary(vf_task)[0]:
        fired = await call_hook(fn, {Trace: trace})
        if not isinstance(fired, bool):
            raise TypeError(f"@stop {fn.__name__} must return bool, got {type(fired).__name__}")
        if fired:
            return fn.__name__
    return None


def _refuse_message_hooks(vf_task: Any, env_id: str) -> None:
    """Stops and interceptors on a request or response act on verifiers' message dialects, which this
    adapter does not use (a model turn is text): refused, rather than silently not applied."""
    from verifiers.v1.utils.decorators import discover_decorated

    hooks = [fn.__name__ for fn in _stops_by_boundary(vf_task)[1]]
    hooks += [fn.__name__ for fn in discover_decorated(vf_task, "intercept")]
    if hooks:
        raise UserError(f"environment {env_id}: its task hooks requests or responses ({', '.join(sorted(hooks))}); "
                        "primebuild applies only @vf.stop on the trace",
                        hint="write the stop on the trace (a `trace: vf.Trace` parameter)")
