"""What one episode's bash-harness program costs in CPU: started as its own process in a sandbox of its own
(how each episode ran before program_zygote.py) beside forked from the zygote, side by side.

Runs verifiers' real chat program (the source its bash harness launches, `--bash`) `--episodes` times each
way, one after the other, against a stub chat endpoint on this host that streams what a policy would say:
a `bash` call `cat secret.txt`, then `done`. The command really runs (each way in its sandbox) and its
output is checked. Prints per way the CPU seconds per episode of everything the episode ran (program,
bridge, bwrap, command: the kernel's counts of reaped descendants), the wall seconds per episode, and the
ratio. The own-process way counts the program process and the commands it waited for (a wrapper in the
sandbox reads its rusage: a sandbox's PID namespace hides reaped descendants from the host), not its bridge
process or bwrap; the forked way counts the zygote's CPU and its reaped children's (program, bridge thread,
commands). The forked way's first episode teaches the zygote what the program imports as it runs; it is
counted.

    .venv/bin/python bench/harness_program_cpu.py [--episodes 20]
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import json
import sys
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

from primebuild.runtime.envs.sandbox import PYTHON  # noqa: E402
from primebuild.runtime.envs.sandbox_runtime import SandboxLimits, SandboxRuntime  # noqa: E402

MEASURE = """import json, resource, runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    own, waited = (resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    with open("cpu.json", "w") as f:
        json.dump(own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime, f)
"""
CALL = {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "cat secret.txt"}'}}


class Policy(http.server.BaseHTTPRequestHandler):
    """Streams a chat completion: a bash call while no tool result is in the conversation, then `done`."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        answered = any(m.get("role") == "tool" for m in body["messages"])
        delta = {"role": "assistant", "content": "done"} if answered else {"role": "assistant", "tool_calls": [
            {"index": 0, **CALL}]}
        chunks = [{"choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
                  {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop" if answered else "tool_calls"}]},
                  {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for chunk in chunks:
            chunk.update(id="stub", object="chat.completion.chunk", created=0, model="policy")
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


def zygote_cpu(runtime: SandboxRuntime) -> float:
    """The zygote Python's own CPU and that of the children it reaped (its programs and their commands)."""
    root = psutil.Process(runtime.zygote.process.pid)
    (python,) = [p for p in root.children(recursive=True) if "zygote_main.py" in " ".join(p.cmdline())
                 and p.name().startswith("python")]
    t = python.cpu_times()
    return t.user + t.system + t.children_user + t.children_system


async def episode(port: int, forked: bool, source: str) -> tuple[float, float]:
    """One episode's (CPU seconds, wall seconds); its command's output is checked."""
    runtime = SandboxRuntime(SandboxLimits(cpu_seconds=20, wall_seconds=60))
    await runtime.start()
    try:
        await runtime.prepare_execution([f"http://127.0.0.1:{port}/v1"])
        await runtime.write("secret.txt", b"s3cret")
        args = [f"--base-url=http://127.0.0.1:{port}/v1", "--api-key=x", "--model=policy", "--bash",
                "--prompt=what does secret.txt say?"]
        if forked:
            program = await runtime.prepare_uv_script(source)
            before = zygote_cpu(runtime)
        else:
            await runtime.write("program.py", source.encode())
            await runtime.write("measure.py", MEASURE.encode())
            program = [PYTHON, "measure.py", "program.py"]
        started = time.perf_counter()
        result = await runtime.run([*program, *args], {})
        wall = time.perf_counter() - started
        assert result.exit_code == 0, result.stderr[-2000:]
        cpu = zygote_cpu(runtime) - before if forked else json.loads(await runtime.read("cpu.json"))
        return cpu, wall
    finally:
        await runtime.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--episodes", type=int, default=20)
    args = parser.parse_args()
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Policy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    rows = {}
    for forked in (False, True):
        runs = [asyncio.run(episode(server.server_port, forked, CHAT_PROGRAM_SOURCE)) for _ in range(args.episodes)]
        rows["forked from the zygote" if forked else "own process, own sandbox"] = runs
    server.shutdown()
    print(f"{'each episode':28} {'CPU s (mean)':>12} {'CPU s (last half)':>17} {'wall s (mean)':>13}")
    for name, runs in rows.items():
        half = runs[len(runs) // 2:]
        print(f"{name:28} {sum(c for c, _ in runs) / len(runs):12.3f} {sum(c for c, _ in half) / len(half):17.3f} "
              f"{sum(w for _, w in runs) / len(runs):13.3f}")
    (own, forked) = rows.values()
    ratio = sum(c for c, _ in own) / sum(c for c, _ in forked)
    print(f"CPU per episode, own process / forked: {ratio:.1f}x ({args.episodes} episodes each)")


if __name__ == "__main__":
    main()
