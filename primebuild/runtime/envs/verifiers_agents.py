"""A verifiers (0.4) taskset with tools, played by verifiers' own harness program against the policy.

verifiers runs tool use itself: for each rollout its `Agent` starts the task's MCP toolsets, its own
interception server and a harness program (`null`: a chat loop over the OpenAI API that calls the MCP
tools the model asks for). Here that whole path runs unchanged, with one
difference: the program's model endpoint is primebuild's `ChatInterception` (chat_interception.py),
which renders the conversation with the model's chat template token in / token out, samples every model
turn through the orchestrator's inference client and records its ids, log-probs and policy version. The
episode's token sequence is that recording; its reward is the trace's, scored by the task's own
`@vf.reward`s when verifiers' rollout closes.

Manifest args (besides the taskset's config fields): `num_eval`, `harness` ("null" or "bash"),
`max_turns` (model turns per episode, verifiers' agent limit).

`null`: the program runs as a local subprocess (verifiers' SubprocessRuntime; verifiers installs its
script's dependencies with uv on first use); its only tools are the taskset's MCP tools.
`bash`: verifiers' bash harness, whose `bash` tool runs the model's shell commands. Each episode's program
is forked, its imports done, from a sandboxed zygote (no network but the model's endpoint, rlimits), and
every command it runs is in a bubblewrap sandbox of its own (its episode's folder, no network at all;
sandbox_runtime.py, program_zygote.py), with the limits `cpu_seconds`, `memory_mb`, `command_seconds`
and `wall_seconds` from the manifest's args (defaults: SandboxLimits). An episode killed at its wall limit
is scored 0 and the run goes on. The harness's `edit` tool and context compaction are off (compaction
rewrites history, which the token-in/out recording refuses).
"""

from __future__ import annotations

from typing import Any

from primebuild.contracts.environments import BASH_SANDBOX_LIMITS
from primebuild.errors import UserError
from primebuild.runtime.envs.base import Task, finite_reward
from primebuild.runtime.envs.verifiers_adapter import VERIFIERS_TASK, VerifiersEnvironment, _import_verifiers

HARNESSES = ("null", "bash")
INTERCEPTION_KEY_ENV = "PRIMEBUILD_INTERCEPTION_KEY"  # the program's API key; the interception checks none


class VerifiersAgentEnvironment(VerifiersEnvironment):
    """Episodes played by a verifiers harness program (tools included); see the module docstring."""

    plays_itself = True  # the orchestrator hands it an endpoint instead of driving its turns

    def __init__(self, taskset: Any, *, env_id: str, version: str, num_eval: int = 200, harness: str = "null",
                 max_turns: int = 8, **limits: int):
        if harness not in HARNESSES:
            raise UserError(f"environment {env_id}: harness {harness!r} is not one primebuild runs",
                            hint=f"one of {', '.join(HARNESSES)}")
        for name, value in limits.items():
            if name not in BASH_SANDBOX_LIMITS or harness != "bash":
                raise UserError(f"environment {env_id}: {name} is not an arg of the {harness} harness",
                                hint=f"the bash harness's sandbox limits: {', '.join(BASH_SANDBOX_LIMITS)}")
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"environment {env_id}: {name} must be a positive integer, got {value!r}")
        self.limits = limits
        if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
            raise UserError(f"environment {env_id}: max_turns must be a positive integer, got {max_turns!r}")
        super().__init__(taskset, env_id=env_id, version=version, num_eval=num_eval)
        self.harness, self.max_turns = harness, max_turns

    def agent(self, base_url: str) -> Any:
        """verifiers' own Agent, its model at `base_url`: the harness program on a local subprocess (null), or
        in the sandbox runtime that `play` lends it (bash)."""
        import os

        vf = _import_verifiers()
        from verifiers.v1.configs.client import EvalClientConfig
        from verifiers.v1.runtimes import SubprocessConfig
        from verifiers.v1.utils.loaders import harness_config_type

        os.environ.setdefault(INTERCEPTION_KEY_ENV, "primebuild")
        harness = harness_config_type(self.harness)(id=self.harness)
        if self.harness == "bash":  # its shell tool only; compaction would rewrite the recorded history
            harness = harness.model_copy(update={"edit": False, "compaction": None})
        config = vf.AgentConfig(harness=harness, runtime=SubprocessConfig(),
                                model="policy", max_turns=self.max_turns,
                                client=EvalClientConfig(base_url=base_url, api_key_var=INTERCEPTION_KEY_ENV))
        return vf.Agent(config)

    async def play(self, task: Task, base_url: str) -> tuple[float, str]:
        """One episode; returns (reward, why it stopped). The tokens are what the interception recorded."""
        runtime = None
        if self.harness == "bash":
            from primebuild.runtime.envs.sandbox_runtime import SandboxLimits, SandboxRuntime

            runtime = SandboxRuntime(SandboxLimits(**self.limits))
        try:
            if runtime is not None:  # borrowed by verifiers' rollout: we start and stop it
                await runtime.start()
            async with self.agent(base_url) as agent:
                trace = await agent.run(task.info[VERIFIERS_TASK], runtime=runtime)
        finally:
            if runtime is not None:
                await runtime.stop()
        if runtime is not None and runtime.wall_killed:  # over its time: ended, scored 0, the run goes on
            return 0.0, "sandbox_wall_limit"
        if not trace.ok:
            errors = "; ".join(f"{e.type}: {e.message}"[:300] for e in trace.errors) or "no error recorded"
            raise RuntimeError(f"environment {self.id}: the {self.harness} harness failed: {errors}")
        reward = 0.0 if trace.reward is None else finite_reward(self.id, trace.reward)  # None: nothing scored it
        return reward, str(trace.stop_condition or "agent_completed")

    def demonstration(self, task: Task, rng) -> list[tuple[bool, str]]:
        raise UserError(f"environment {self.id}: a tool-using verifiers taskset has no demonstrations to imitate",
                        hint="start RL from a model that already calls its tools")
