"""A multi-turn verifiers (0.4) environment, loaded by id from an installed package, played end to end by
primebuild's own rollout loop against the real embedded inference engine.

The package (tests/data/verifiers_guess_letter, `pb-guess-letter`) is pip-installed here into a folder put
on sys.path; its `vf.Env.run` plays the user (`no` after every reply without the hidden letter) and its
task scores the trace with its own `@vf.reward`. The policy is a random tiny character model, so what it
says is arbitrary; every expectation below is recomputed from the tokens it actually sampled.
"""

from __future__ import annotations

import asyncio
import importlib
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

vf = pytest.importorskip(
    "verifiers.v1", reason="verifiers is not installed (pip install verifiers==0.4.0); adapter untested here"
)

from primebuild.builders.environments import adapter_arg_problems, verifiers_problem  # noqa: E402
from primebuild.errors import UserError  # noqa: E402
from primebuild.runtime.envs.base import MultiTurnEnvironment, max_turns  # noqa: E402
from primebuild.runtime.envs.registry import load_environment  # noqa: E402
from primebuild.runtime.envs.transcript import encode_prompt, encode_reply  # noqa: E402

PACKAGE = Path(__file__).parent / "data" / "verifiers_guess_letter"
ENV_ID = "verifiers:pb-guess-letter"
GUESSES = 4
# the character model's chat framing: a user message ends with `>`, a model turn with <eos>
FRAMING = {"prompt_format": "{prompt}>", "reply_format": "{message}>"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """pb-guess-letter installed with pip (no dependencies: verifiers is already here) and importable."""
    source, target = tmp_path_factory.mktemp("source") / "package", tmp_path_factory.mktemp("site")
    shutil.copytree(PACKAGE, source)  # setuptools writes build/ and *.egg-info next to the sources
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(target), str(source)], check=True, capture_output=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(target))
        importlib.invalidate_caches()
        yield importlib.import_module("pb_guess_letter")


def _spans(transcript):
    """[(loss mask, ids)] runs of the completion: model turns (1) and environment replies (0)."""
    spans = []
    for token, mask in zip(transcript.completion_ids, transcript.loss_mask, strict=True):
        if spans and spans[-1][0] == mask:
            spans[-1][1].append(token)
        else:
            spans.append((mask, [token]))
    return spans


@pytest.fixture(scope="module")
def played(installed, tmp_path_factory):
    """Two environments (the game's own limit of 4 guesses; a turn budget of 2), 3 tasks x 4 episodes each.
    The server's policy version moves from 0 to 1 after each group's first turn."""
    import torch
    from inference_helpers import serve_folder
    from transformers import AutoTokenizer

    from primebuild.runtime.models.tiny import build_tiny_model
    from primebuild.runtime.orchestrator.client import InferenceClient
    from primebuild.runtime.orchestrator.rollout import RolloutRunner

    torch.set_num_threads(1)
    model = build_tiny_model(tmp_path_factory.mktemp("vfmt") / "model", seed=5)
    tokenizer = AutoTokenizer.from_pretrained(model)
    envs = {budget: load_environment(ENV_ID, None, {"letters": "aeiost", "max_guesses": GUESSES, "num_eval": 3,
                                                    "max_turns": budget, **FRAMING})
            for budget in (8, 2)}
    runner = RolloutRunner(tokenizer, max_tokens_per_turn=6, seq_len=200)
    groups = {}
    with serve_folder(model, max_model_len=200) as served:
        client = InferenceClient(served.v1, "tiny")

        async def play():
            version = 0
            try:
                for budget, env in envs.items():
                    for i, task in enumerate(env.eval_tasks()):
                        calls = 0

                        async def sample(prompt_ids, **kw):
                            nonlocal calls, version
                            answer = await client.complete(prompt_ids, top_p=1.0, **kw)
                            calls += 1
                            if calls == 1:  # a weight update between the first turn and the rest
                                version += 1
                                update = {"path": str(model), "version": version}
                                reply = await asyncio.to_thread(served.admin, "/update_weights", update)
                                assert reply.status_code == 200, reply.text
                            return answer

                        group = await runner.group(sample, env, task, n=4, temperature=1.0, seed=100 * budget + i)
                        groups[budget, i] = (task, version - 1, group)
            finally:
                await client.close()

        asyncio.run(play())
    return tokenizer, envs, groups


def _expected(installed, tokenizer, transcript, letter, budget):
    """What the game's rules give for the model turns actually sampled: (turns, finish, reward)."""
    turns = [tokenizer.decode(ids, skip_special_tokens=True) for m, ids in _spans(transcript) if m == 1]
    found = installed.first_find(turns, letter)
    limit = min(GUESSES, budget)
    if found is not None and found <= limit:
        return found, "episode", (GUESSES - found + 1) / GUESSES
    return limit, "episode" if limit == GUESSES else "turns", 0.0


def test_the_package_loads_by_id_as_a_multi_turn_environment(installed):
    assert verifiers_problem("pb-guess-letter") is None  # the plan's check finds the installed module
    env = load_environment(ENV_ID, None, {"num_eval": 5, "max_turns": 3, **FRAMING})
    assert isinstance(env, MultiTurnEnvironment) and max_turns(env) == 3
    assert env.id == ENV_ID and env.version == "0.1.0"  # the installed distribution's version
    task = env.eval_tasks()[0]
    assert env.format_prompt(task) == task.prompt + ">" and task.answer in "abcdefghijklmnopqrstuvwxyz"
    assert not {t.info["content_key"] for t in env.eval_tasks()} & {
        t.info["content_key"] for t in env.sample_tasks(__import__("random").Random(0), 300)}


def test_rollouts_alternate_model_turns_and_the_envs_replies(played, installed):
    tokenizer, envs, groups = played
    no = encode_reply(tokenizer, installed.NO + ">")
    turn_counts = set()
    for (budget, _), (task, first_version, group) in groups.items():
        env = envs[budget]
        for rollout in group:
            t = rollout.transcript
            turns, finish, _ = _expected(installed, tokenizer, t, task.answer, budget)
            assert (t.turns, rollout.finish) == (turns, finish)
            turn_counts.add(t.turns)
            assert t.prompt_ids == encode_prompt(tokenizer, task.prompt + ">")
            spans = _spans(t)
            assert [m for m, _ in spans] == [1, 0] * (turns - 1) + [1]
            assert all(ids == no for m, ids in spans if m == 0)  # the Env's `no`, framed, verbatim
            assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if not m)
            assert all(lp < 0.0 for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m)
            # the first turn was sampled before the weight update, every later one after it
            assert t.turn_versions == [first_version] + [first_version + 1] * (turns - 1)
            sample = rollout.sample(env.id)
            sample.validate_shapes("rollout")
            assert sample.num_loss_tokens == t.model_tokens and sample.policy_version == first_version
    assert len(turn_counts) > 1, turn_counts  # episodes of different lengths, ended by the game or the budget


def test_rewards_are_the_tasks_own_scoring(played, installed):
    tokenizer, _, groups = played
    rewards = []
    for (budget, _), (task, _, group) in groups.items():
        for rollout in group:
            _, _, reward = _expected(installed, tokenizer, rollout.transcript, task.answer, budget)
            assert rollout.reward == pytest.approx(reward)
            rewards.append(rollout.reward)
    assert min(rewards) == 0.0 and max(rewards) > 0.0, rewards  # both outcomes occur


MULTI_SEAT = textwrap.dedent(
    """
    import verifiers.v1 as vf
    from pb_guess_letter import GuessLetterTaskset

    __all__ = ["DuetEnv", "DuetTaskset"]


    class DuetTaskset(GuessLetterTaskset):
        pass


    class DuetConfig(vf.EnvConfig):
        player: vf.AgentConfig = vf.AgentConfig()
        judge: vf.AgentConfig = vf.AgentConfig()


    class DuetEnv(vf.Env[DuetConfig]):
        async def run(self, task, agents):
            await agents.player.run(task)
    """
)

SILENT_USER = textwrap.dedent(
    """
    import verifiers.v1 as vf
    from pb_guess_letter import GuessLetterData, GuessLetterEnv, GuessLetterTask, GuessLetterTaskset

    __all__ = ["SilentEnv", "SilentTaskset"]


    class SilentTaskset(GuessLetterTaskset):
        def load(self):
            for letter in "abcdefgh":
                yield GuessLetterTask(GuessLetterData(prompt=None, answer=letter, max_guesses=2), self.config.task)


    class SilentEnv(GuessLetterEnv):
        pass
    """
)


def test_what_the_rollout_loop_cannot_drive_is_refused_when_loading(installed, tmp_path, monkeypatch):
    (tmp_path / "pb_duet.py").write_text(MULTI_SEAT)
    (tmp_path / "pb_silent.py").write_text(SILENT_USER)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match=r"2 agent seats \(player, judge\)"):
        load_environment("verifiers:pb-duet", None, {"num_eval": 3})
    with pytest.raises(UserError, match="8 tasks have no prompt"):
        load_environment("verifiers:pb-silent", None, {"num_eval": 3})
    with pytest.raises(UserError, match="reply_format must be a string holding"):
        load_environment(ENV_ID, None, {"num_eval": 3, "reply_format": "no placeholder"})
    with pytest.raises(UserError, match="invalid args"):
        load_environment(ENV_ID, None, {"max_guesses": "many"})
    env = load_environment(ENV_ID, None, {"num_eval": 3})
    with pytest.raises(UserError, match="no demonstrations"):
        env.demonstration(env.eval_tasks()[0], None)


def test_the_plan_checks_the_adapters_own_args_without_importing_verifiers():
    assert list(adapter_arg_problems({"max_turns": 4, "prompt_format": "{prompt}>", "env": {}})) == []
    problems = dict(adapter_arg_problems({"max_turns": 0, "reply_format": "x", "num_eval": True, "env": []}))
    assert set(problems) == {"max_turns", "reply_format", "num_eval", "env"}
    assert "{message}" in problems["reply_format"]


VARIANTS = textwrap.dedent(
    """
    import verifiers.v1 as vf
    from pb_guess_letter import GuessLetterEnv, GuessLetterTask, GuessLetterTaskset


    class QuitTask(GuessLetterTask):
        @vf.stop
        async def gave_up(self, trace: vf.Trace) -> bool:
            return trace.last_reply == "quit"


    class QuitTaskset(GuessLetterTaskset):
        def load(self):
            for task in super().load():
                yield QuitTask(task.data, self.config.task)


    class RequestStopTask(GuessLetterTask):
        @vf.stop
        async def too_long(self, request: vf.Request) -> bool:
            return len(request.messages) > 3


    class RequestStopTaskset(GuessLetterTaskset):
        def load(self):
            for task in super().load():
                yield RequestStopTask(task.data, self.config.task)


    class Calculator(vf.Toolset):
        @vf.tool
        async def add(self, a: int, b: int) -> int:
            return a + b


    class ToolTask(GuessLetterTask):
        @classmethod
        def toolsets(cls, config):
            return [Calculator(vf.ToolsetConfig())]


    class ToolTaskset(GuessLetterTaskset):
        def load(self):
            for task in super().load():
                yield ToolTask(task.data, self.config.task)


    class SpectatorEnv(GuessLetterEnv):
        async def setup(self, agents):
            agents.player.trainable = False


    class BrokenEnv(GuessLetterEnv):
        async def run(self, task, agents):
            async with agents.player.interaction(task) as game:
                await game.turn()
                raise ValueError("the referee fell over")
    """
)


def _variant(tmp_path, monkeypatch, module: str, taskset: str, env: str | None = "GuessLetterEnv") -> str:
    """A one-module package exporting `taskset` and `env` (None: no Env, single-turn) from VARIANTS; returns
    its environment id."""
    (tmp_path / "pb_variants.py").write_text(VARIANTS)
    names = [taskset] if env is None else [taskset, env]
    (tmp_path / f"{module}.py").write_text(f"from pb_variants import {', '.join(names)}\n\n__all__ = {names!r}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"verifiers:{module}"


def _play(env, task, replies):
    """Drive one episode through the Episode protocol, as the rollout loop does: (env replies, reward, trace)."""
    async def play():
        episode = env.start(task)
        answers = []
        try:
            for reply in replies:
                answers.append(await episode.step(reply))
                if answers[-1] is None:
                    break
            return answers, await episode.reward(), episode.seat.trace
        finally:
            await episode.close()

    return asyncio.run(play())


def test_an_episode_follows_the_envs_own_rules_turn_by_turn(installed, tmp_path, monkeypatch):
    env = load_environment(ENV_ID, None, {"num_eval": 3, "max_guesses": GUESSES, **FRAMING})
    task = env.eval_tasks()[0]
    wrong = "z" if task.answer != "z" else "y"
    # found at the third reply: the Env said `no` twice, then run() returned
    answers, reward, trace = _play(env, task, [wrong, wrong, f"{wrong}{task.answer}"])
    assert answers == ["no>", "no>", None] and reward == pytest.approx(0.5)
    assert [m.role for m in trace.messages] == ["user", "assistant", "user", "assistant", "user", "assistant"]
    assert trace.rewards["found"].score == pytest.approx(0.5) and trace.metrics["replies"] == 3.0
    # never found: the game's own limit ends it
    answers, reward, trace = _play(env, task, [wrong] * 6)
    assert answers == ["no>"] * (GUESSES - 1) + [None] and reward == 0.0
    # the rollout loop stops first (a budget): the Env's pending turn comes back terminated
    answers, reward, trace = _play(env, task, [wrong])
    assert answers == ["no>"] and reward == 0.0 and trace.stop_condition == "max_total_tokens"
    assert trace.num_turns == 1

    quits = load_environment(_variant(tmp_path, monkeypatch, "pb_quit", "QuitTaskset"), None,
                             {"num_eval": 3, **FRAMING})
    answers, reward, trace = _play(quits, quits.eval_tasks()[0], ["quit", wrong])
    assert answers == [None] and trace.stop_condition == "gave_up" and reward == 0.0

    broken = load_environment(_variant(tmp_path, monkeypatch, "pb_broken", "GuessLetterTaskset", "BrokenEnv"), None,
                              {"num_eval": 3})
    with pytest.raises(RuntimeError, match="verifiers:pb_broken: ValueError: the referee fell over"):
        _play(broken, broken.eval_tasks()[0], [wrong])
    spectator = load_environment(_variant(tmp_path, monkeypatch, "pb_spectator", "GuessLetterTaskset", "SpectatorEnv"),
                                 None, {"num_eval": 3})
    with pytest.raises(RuntimeError, match="marks the player seat untrainable"):
        _play(spectator, spectator.eval_tasks()[0], [wrong])


def test_closing_an_abandoned_episode_cancels_the_envs_run(installed):
    """A stale group is abandoned between turns (no reward): close() must end the Env's pending run()."""
    env = load_environment(ENV_ID, None, {"num_eval": 3, **FRAMING})

    async def abandon():
        task = env.eval_tasks()[0]
        episode = env.start(task)
        assert await episode.step("z" if task.answer != "z" else "y") == "no>"
        runner = episode.runner
        assert not runner.done()  # run() waits in turn() for the next model turn
        await episode.close()
        return runner

    runner = asyncio.run(abandon())
    assert runner.cancelled()


def test_hooks_the_adapter_does_not_apply_are_refused(installed, tmp_path, monkeypatch):
    with pytest.raises(UserError, match=r"hooks requests or responses \(too_long\)"):
        load_environment(_variant(tmp_path, monkeypatch, "pb_request_stop", "RequestStopTaskset"), None, {"num_eval": 3})
    with pytest.raises(UserError, match=r"its tasks use tools \(Calculator\)"):
        load_environment(_variant(tmp_path, monkeypatch, "pb_tools", "ToolTaskset"), None, {"num_eval": 3})
    with pytest.raises(UserError, match="apply to multi-turn environments only"):
        load_environment(_variant(tmp_path, monkeypatch, "pb_plain", "GuessLetterTaskset", None), None,
                         {"max_turns": 3})
