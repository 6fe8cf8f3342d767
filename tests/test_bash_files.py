"""The bash-files taskset (bench/tasksets/pb_bash_files.py) that bench/bash_files.py trains through verifiers'
bash harness: its held-out names never reach training, its setup writes the files into the rollout's
bubblewrap sandbox only, and its reward is 1 for the command that prints the named file and 0 for one
that prints another file or every file. Cheap: no model, no training (the learning run is the bench's)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
pytest.importorskip("verifiers.v1", reason="verifiers is not installed")

TASKSETS = Path(__file__).resolve().parent.parent / "bench" / "tasksets"


@pytest.fixture
def files_env(monkeypatch):
    from primebuild.runtime.envs.registry import load_environment

    monkeypatch.syspath_prepend(str(TASKSETS))
    return load_environment("verifiers:pb-bash-files", None, {"harness": "bash", "max_turns": 2, "num_eval": 32})


def _data(task):
    from primebuild.runtime.envs.verifiers_adapter import VERIFIERS_TASK

    return task.info[VERIFIERS_TASK].data


def test_the_held_out_names_never_reach_training(files_env):
    import random

    import pb_bash_files

    held_out = {_data(t).name for t in files_env.eval_tasks()}
    trained = {_data(t).name for t in files_env.sample_tasks(random.Random(0), 5000)}
    assert len(held_out) == 32 and not held_out & trained
    assert held_out | trained == set(pb_bash_files.file_names())  # 5000 draws reach all 224 training names
    for task in files_env.eval_tasks():
        assert _data(task).name in task.prompt and _data(task).text not in task.prompt  # only a command reads it


def _trace(vf_task, outputs: list[str]):
    """A trace whose tool messages are `outputs` (what the bash tool returned)."""
    import verifiers.v1 as vf
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import TraceTask

    nodes = [MessageNode(message=vf.UserMessage(content=vf_task.data.prompt))]
    for output in outputs:
        nodes.append(MessageNode(parent=len(nodes) - 1, message=vf.AssistantMessage(content="calling"), sampled=True))
        nodes.append(MessageNode(parent=len(nodes) - 1, message=vf.ToolMessage(tool_call_id="c", content=output)))
    return vf.Trace(task=TraceTask(type=type(vf_task).__name__, data=vf_task.data, key=vf_task.key, hash=vf_task.hash),
                    agent=vf.AgentInfo(config=vf.AgentConfig(), name="test", trainable=False), nodes=nodes)


def test_setup_writes_the_files_in_the_sandbox_and_only_the_named_file_scores(files_env):
    from primebuild.runtime.envs.sandbox_runtime import SandboxRuntime
    from primebuild.runtime.envs.verifiers_adapter import VERIFIERS_TASK

    task = files_env.eval_tasks()[0]
    vf_task, data = task.info[VERIFIERS_TASK], _data(task)
    decoy = next(iter(data.decoys))

    async def run():
        runtime = SandboxRuntime()
        await runtime.start()
        try:
            await vf_task.setup(None, runtime)
            outputs = {}
            for command in (f"cat {data.name}", f"cat {decoy}", "cat *", "ls"):
                result = await runtime.run(["bash", "-c", command], {})
                outputs[command] = result.stdout
            workdir = runtime.workdir
        finally:
            await runtime.stop()
        rewards = {}
        for command, output in outputs.items():
            trace = _trace(vf_task, [output])
            await vf_task.score(trace)
            rewards[command] = float(trace.reward)
        return outputs, rewards, workdir

    outputs, rewards, workdir = asyncio.run(run())
    assert sorted(outputs["ls"].split()) == sorted([data.name, *data.decoys])  # setup wrote them in the sandbox
    assert not (Path.cwd() / data.name).exists() and not workdir.exists()  # nowhere else, and removed after
    assert outputs[f"cat {data.name}"] == data.text
    assert rewards == {f"cat {data.name}": 1.0, f"cat {decoy}": 0.0, "cat *": 0.0, "ls": 0.0}
    trace = _trace(vf_task, [outputs["ls"], outputs[f"cat {data.name}"]])  # a later right command still counts
    asyncio.run(vf_task.score(trace))
    assert trace.reward == 1.0
