"""verifiers' bash harness in primebuild's bubblewrap sandbox (primebuild/runtime/envs/sandbox_runtime.py).

First the sandbox runtime on its own: a program in it reaches the one endpoint it was given (through the
unix-socket bridge) and nothing else, and its commands are ended at their CPU and wall limits. Then the
whole path: verifiers' own bash harness, its model being primebuild's interception over the embedded
engine with a tiny model taught to answer with `cat secret.txt`; the command runs in the sandbox, where
the task's setup wrote the file, and the task's reward reads its output from the trace."""

from __future__ import annotations

import asyncio
import functools
import http.server
import os
import shutil
import threading
import time

import pytest

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
pytest.importorskip("verifiers.v1", reason="verifiers is not installed")

CALL = '<tool_call>{"name": "bash", "arguments": {"command": "cat secret.txt"}}</tool_call>'


@pytest.fixture
def host_servers():
    """Two HTTP servers on this host's loopback: the sandbox is given the first one only."""
    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"hello from the host")

        def log_message(self, *args):
            pass

    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hello) for _ in range(2)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield [server.server_port for server in servers]
    for server in servers:
        server.shutdown()
        server.server_close()


PROBE_HELPERS = '''
import subprocess, sys, time, httpx

def get(url):
    try:
        return httpx.get(url, timeout=3).text
    except Exception as e:
        return type(e).__name__

def bash(command):
    start = time.time()
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True)
    return done.returncode, round(time.time() - start, 1), done.stdout.strip()
'''
PROBE = PROBE_HELPERS + '''
print("allowed:", get("http://127.0.0.1:{allowed}/"))
print("other port:", get("http://127.0.0.1:{other}/"))
print("network:", get("http://1.1.1.1/"))
print("spin:", bash("while :; do :; done"))
print("sleep:", bash("sleep 60"))
print("file:", bash("cat secret.txt; pwd"))
'''


def test_the_sandbox_runtime_reaches_only_its_routes_and_ends_commands_at_their_limits(host_servers):
    from primebuild.runtime.envs.sandbox_runtime import SandboxLimits, SandboxRuntime

    allowed, other = host_servers

    async def run():
        runtime = SandboxRuntime(SandboxLimits(cpu_seconds=1, command_seconds=4, wall_seconds=40))
        await runtime.start()
        try:
            await runtime.prepare_execution([f"http://localhost:{allowed}/v1"])
            await runtime.write("secret.txt", b"s3cret")
            await runtime.write("probe.py", PROBE.format(allowed=allowed, other=other).encode())
            python, _ = await runtime.prepare_uv_script('# /// script\n# dependencies = ["httpx"]\n# ///\n')
            result = await runtime.run([python, "probe.py"], {})
            folders = runtime.workdir, runtime.support
        finally:
            await runtime.stop()
        return result, folders

    result, folders = asyncio.run(run())
    assert result.exit_code == 0, result.stderr
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines())
    assert lines["allowed"] == "hello from the host"  # through the bridge
    assert lines["other port"] == "ConnectError" and lines["network"] == "ConnectError"
    code, seconds, _ = eval(lines["spin"])
    assert code in (-24, -9, 124) and seconds < 5  # SIGXCPU at 1 CPU second (or `timeout` at 4 s, under load)
    code, seconds, _ = eval(lines["sleep"])
    assert code == 124 and seconds < 10  # `timeout` at command_seconds
    assert eval(lines["file"])[2] == "s3cret/work"  # the file task setup wrote; the sandbox folder is /work
    assert not any(folder.exists() for folder in folders)  # removed with the runtime, sockets included


HARNESS_PROBE = '''# /// script
# dependencies = ["httpx"]
# ///
import sys
preloaded = "httpx" in sys.modules  # before this script imports it: the zygote did
''' + PROBE_HELPERS + '''
print("preloaded:", preloaded)
print("argv:", sys.argv[1:])
print("allowed:", get("http://127.0.0.1:{allowed}/"))
print("other port:", get("http://127.0.0.1:{other}/"))
print("command to the allowed port:", bash("exec 3<>/dev/tcp/127.0.0.1/{allowed} && echo connected"))
print("command's view:", bash("cat secret.txt; pwd; ls {episodes} || echo hidden; ulimit -t"))
print("sleep:", bash("sleep 60"))
sys.exit(3)
'''


def test_the_harness_program_is_forked_with_its_imports_done_and_its_commands_are_sandboxed(host_servers):
    """The program prepare_uv_script returns is forked from the process's zygote (program_zygote.py): its
    dependencies are already imported; it reaches its route only; each command it runs is in a sandbox of
    its own (its episode's folder as /work, no other folder, no network at all, the CPU limit, `timeout`);
    its exit code and output come back; a program past the episode's wall limit is killed."""
    from primebuild.runtime.envs.sandbox_runtime import WALL_KILLED, SandboxLimits, SandboxRuntime

    allowed, other = host_servers

    async def run():
        runtime, slow = (SandboxRuntime(SandboxLimits(cpu_seconds=2, command_seconds=2, wall_seconds=s))
                         for s in (40, 3))
        for r in (runtime, slow):
            await r.start()
        try:
            await runtime.prepare_execution([f"http://localhost:{allowed}/v1"])
            await runtime.write("secret.txt", b"s3cret")
            program = await runtime.prepare_uv_script(HARNESS_PROBE.format(
                allowed=allowed, other=other, episodes=runtime.zygote.root))
            result = await runtime.run([*program, "--prompt=hi"], {})
            sleeper = await slow.prepare_uv_script('# dependencies = ["httpx"]\nimport time\ntime.sleep(60)\n')
            started = time.monotonic()
            killed = await slow.run(sleeper, {})
            seconds = time.monotonic() - started
            broken = await slow.run(await slow.prepare_uv_script('# dependencies = ["httpx"]\ndef (:\n'), {})
            again = await runtime.run([*program, "--prompt=again"], {})  # the zygote still serves
            return result, killed, seconds, slow.wall_killed, broken, again
        finally:
            for r in (runtime, slow):
                await r.stop()

    result, killed, seconds, wall_killed, broken, again = asyncio.run(run())
    assert result.exit_code == 3, result.stderr
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines())
    assert lines["preloaded"] == "True" and lines["argv"] == "['--prompt=hi']"
    assert lines["allowed"] == "hello from the host" and lines["other port"] == "ConnectError"
    assert eval(lines["command to the allowed port"])[2] == ""  # a command has no network, not even the route
    view = eval(lines["command's view"])[2]
    assert view.split("\n") == ["s3cret/work", "hidden", "2"]  # the file has no newline
    assert eval(lines["sleep"])[0] == 124  # `timeout` at command_seconds
    assert killed.exit_code == WALL_KILLED and wall_killed and seconds < 15
    assert broken.exit_code == 1 and "SyntaxError" in broken.stderr  # as `python script` reports it
    assert again.exit_code == 3 and "argv: ['--prompt=again']" in again.stdout


def test_an_absolute_path_outside_the_sandbox_and_a_missing_dependency_are_refused():
    from primebuild.errors import UserError
    from primebuild.runtime.envs.sandbox_runtime import SandboxRuntime, script_dependencies

    assert script_dependencies('# dependencies = ["openai", "mcp==2.0.0", "httpx2>=2"]') == ["openai", "mcp", "httpx2"]

    async def run():
        runtime = SandboxRuntime()
        await runtime.start()
        try:
            with pytest.raises(UserError, match="outside"):
                await runtime.write("/etc/passwd", b"")
            with pytest.raises(UserError, match="no_such_package_here"):
                await runtime.prepare_uv_script('# dependencies = ["no-such-package-here"]\n')
        finally:
            await runtime.stop()

    asyncio.run(run())


SECRET_TASKSET = '''
import verifiers.v1 as vf


class Row(vf.TaskData):
    secret: str = ""
    blocking: bool = False


class SecretConfig(vf.TasksetConfig):
    blocking: bool = False  # secret.txt is a FIFO nobody writes: `cat secret.txt` blocks until it is killed


class SecretTask(vf.Task[Row]):
    async def setup(self, trace, runtime):  # the file exists only in the rollout's sandbox
        if self.data.blocking:
            await runtime.run(["mkfifo", "secret.txt"], {})
        else:
            await runtime.write("secret.txt", self.data.secret.encode())

    @vf.reward
    async def read_the_file(self, trace) -> float:
        return float(any(m.role == "tool" and self.data.secret in str(m.content) for m in trace.messages))


class SecretTaskset(vf.Taskset[SecretTask, SecretConfig]):
    def load(self):
        for i in range(4):
            yield SecretTask(Row(prompt="what does secret.txt say?", secret=f"k{i}x{i * 7}",
                                 blocking=self.config.blocking), self.config.task)


__all__ = ["SecretTaskset"]
'''


@pytest.fixture(scope="module")
def bash_model(tmp_path_factory):
    import torch
    from chat_helpers import save_chat_model, train_tool_caller
    from verifiers.v1.harnesses.bash.harness import BASH_SYSTEM_PROMPT
    from verifiers.v1.harnesses.utils.core import BASH_TOOL

    torch.set_num_threads(1)
    folder = save_chat_model(tmp_path_factory.mktemp("bash") / "model", seed=2)
    loss = train_tool_caller(folder, [BASH_TOOL], CALL, "done", system=BASH_SYSTEM_PROMPT)
    assert loss < 0.05, loss
    return folder


@pytest.fixture
def secret_env(tmp_path, monkeypatch):
    from primebuild.runtime.envs.registry import load_environment

    (tmp_path / "pb_bash_secret.py").write_text(SECRET_TASKSET)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))

    def load(**limits):
        return load_environment("verifiers:pb-bash-secret", None,
                                {"harness": "bash", "max_turns": 3, "num_eval": 2, **limits})
    return load


def _play(model, env, n=2):
    from test_tool_calls import serve
    from transformers import AutoTokenizer

    from primebuild.runtime.orchestrator.client import InferenceClient
    from primebuild.runtime.orchestrator.rollout import RolloutRunner

    tokenizer = AutoTokenizer.from_pretrained(model)
    runner = RolloutRunner(tokenizer, max_tokens_per_turn=80, seq_len=1024)
    with serve(model) as served:
        async def play():
            client = InferenceClient(served.v1, "tiny")
            try:
                return await runner.group(functools.partial(client.complete, top_p=1.0), env, env.eval_tasks()[0], n=n, temperature=0.0, seed=1)
            finally:
                await client.close()
        return tokenizer, asyncio.run(play())


def test_the_bash_harness_runs_the_models_command_in_the_sandbox(bash_model, secret_env):
    """The model's `cat secret.txt` runs in the sandbox that task setup wrote the file into; the task's
    reward reads the command's output from the trace; the recorded tokens hold the tool result."""
    env = secret_env(cpu_seconds=5, command_seconds=5, wall_seconds=60)
    from primebuild.runtime.envs.verifiers_adapter import VERIFIERS_TASK

    secret = env.eval_tasks()[0].info[VERIFIERS_TASK].data.secret
    tokenizer, rollouts = _play(bash_model, env)
    assert [r.reward for r in rollouts] == [1.0, 1.0]
    t = rollouts[0].transcript
    assert t.turns == 2 and 0 in t.loss_mask and 1 in t.loss_mask
    between = tokenizer.decode([i for i, m in zip(t.completion_ids, t.loss_mask, strict=True) if m == 0])
    assert f"<tool_response>{secret}</tool_response>" in between  # the file that exists only in the sandbox
    assert '"name": "bash"' in tokenizer.decode(t.prompt_ids)  # verifiers' bash tool, rendered by the template


def test_a_command_or_an_episode_over_its_time_is_ended_and_the_episode_scored(bash_model, secret_env):
    """`cat` on a FIFO blocks: at command_seconds the command is killed and the model answers anyway; at
    wall_seconds (command_seconds longer) the whole sandbox is killed. Either way the episode is scored 0
    with its recorded turns, and the group comes back (the run goes on)."""
    tokenizer, (command,) = _play(bash_model, secret_env(blocking=True, command_seconds=2, wall_seconds=60), n=1)
    assert command.reward == 0.0 and command.transcript.turns == 2  # the tool result came back, empty
    assert tokenizer.decode(command.transcript.completion_ids).endswith("done<|im_end|>")
    started = time.monotonic()
    _, (episode,) = _play(bash_model, secret_env(blocking=True, command_seconds=300, wall_seconds=15), n=1)
    assert episode.reward == 0.0 and episode.transcript.turns == 1 and time.monotonic() - started < 60
