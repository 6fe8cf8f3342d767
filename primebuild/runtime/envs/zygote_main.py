"""Runs inside the shared sandbox, standard library only (and sandbox_bridge.py, copied beside it): a Python
that imports a harness program's dependencies once and then forks the program for each episode.

Why: verifiers' bash harness program imports openai, mcp and httpx, ~1.3 s of CPU, and the bash harness
starts one program per episode; on 2 cores that import was ~80% of an RL run's CPU. A forked child starts
with those modules already imported and pays only the episode itself. What a program imports only once it
runs (openai's resources, httpcore, h11: ~540 modules, 0.3 s) each child reports when it ends, and the
zygote imports it too, so the children after start with that as well (measured: 1.6 s of CPU a program
started on its own, 0.40 s forked, 0.07 s forked after the first one's imports were learnt).

    python zygote_main.py CONTROL_SOCKET

One request per connection on CONTROL_SOCKET, a JSON line:
    {"preload": [module, ...]}                       import them here (once); answers {"ok": true}
    {"script": PATH, "args": [...], "cwd": DIR, "env": {...}, "stdout": PATH, "stderr": PATH,
     "routes": {PORT: SOCKET}, "rlimits": [[name, soft, hard], ...]}
        forks a child that runs the script as __main__ and answers {"returncode": N} when it exits.
A connection the host closes before the answer kills its child's process group (an episode's wall limit).
"""

import gc
import hashlib
import json
import os
import resource
import selectors
import signal
import socket
import sys
import threading
import traceback

import sandbox_bridge

compiled: dict[str, object] = {}  # a hash of the script's text -> its code, compiled once here (each episode
# writes the same program to a path of its own: keyed by path, every episode would compile and keep a copy;
# a traceback names the first copy's path)


def bridge_in_thread(routes: dict[str, str]) -> None:
    """The child's listeners on this sandbox's loopback, one per route, each piping to the host's socket."""
    import asyncio

    ready = threading.Event()

    async def serve() -> None:
        for port, path in routes.items():
            await asyncio.start_server(sandbox_bridge.forwarder(lambda path=path: asyncio.open_unix_connection(path)),
                                       "127.0.0.1", int(port))
        ready.set()
        await asyncio.Event().wait()

    threading.Thread(target=asyncio.run, args=(serve(),), daemon=True).start()
    ready.wait(10)


def child(request: dict, code) -> None:
    """In the forked child: the episode's own session, files, environment and limits, then the program."""
    returncode = 1
    imported = set(sys.modules)
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for fd, target in ((null, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
        os.closerange(3, 1 << 16)  # the zygote's control socket and other episodes' connections
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for name, soft, hard in request["rlimits"]:  # the episode's own CPU seconds count from this fork
            resource.setrlimit(getattr(resource, name), (soft, hard))
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        bridge_in_thread(request["routes"])
        sys.argv = [request["script"], *request["args"]]
        sys.path[0] = os.path.dirname(request["script"])
        try:
            exec(code, {"__name__": "__main__", "__file__": request["script"], "__builtins__": __builtins__})
            returncode = 0
        except SystemExit as done:
            returncode = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
            if not isinstance(done.code, int | None):
                print(done.code, file=sys.stderr)
    except BaseException:  # the program's own failure: its traceback is its stderr, as `python script` prints it
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        try:  # what the program imported as it ran (openai's resources, httpcore, ...): the zygote learns it
            with open(request["stdout"] + ".imports", "w") as f:
                json.dump(sorted(set(sys.modules) - imported), f)
        except Exception:
            pass
        os._exit(returncode)


def import_here(names: list[str]) -> dict[str, str]:
    """Import `names` here, so that every child forked after starts with them; returns the failures."""
    failed = {}
    for name in names:
        try:
            __import__(name)
        except Exception as e:
            failed[name] = f"{type(e).__name__}: {e}"
    gc.freeze()  # what is imported now stays shared with the children (no refcount writes by their collector)
    return failed


def preload(names: list[str]) -> dict:
    """A program's declared dependencies: each must import."""
    failed = import_here(names)
    return {"error": "; ".join(f"{n}: {why}" for n, why in failed.items())} if failed else {"ok": True}


def learn_imports(path: str) -> None:
    """What a finished child imported lazily. A name that cannot be imported again (a module a package put
    into sys.modules itself) is skipped."""
    try:
        with open(path) as f:
            names = [name for name in json.load(f) if name not in sys.modules]
        os.unlink(path)
    except (OSError, ValueError):
        return
    if names:
        import_here(names)


def compiled_script(request: dict):
    """The script's code, or None when it cannot be read or compiled: its traceback is then its stderr, as
    `python script` would print it, and the zygote goes on serving the other episodes."""
    try:
        with open(request["script"], "rb") as f:
            text = f.read()
        digest = hashlib.sha256(text).hexdigest()
        if digest not in compiled:
            compiled[digest] = compile(text, request["script"], "exec")
        return compiled[digest]
    except (OSError, SyntaxError, ValueError):
        with open(request["stderr"], "w") as f:
            f.write(traceback.format_exc())
        return None


def answer(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass
    conn.close()


def main(control: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(control)
    listener.listen(256)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    running: dict[int, tuple[socket.socket | None, str]] = {}  # child pid -> the asking connection, its stdout
    pending: dict[socket.socket, bytes] = {}
    print("ready", flush=True)
    os.dup2(2, 1)  # the host reads no more of our stdout: a module that prints as it is imported must not fill it
    while True:
        for key, _ in selector.select(timeout=0.05):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                pending[conn] = b""
                selector.register(conn, selectors.EVENT_READ)
                continue
            conn = key.fileobj
            data = conn.recv(1 << 20)
            if conn in pending:
                pending[conn] += data
                if data and not pending[conn].endswith(b"\n"):
                    continue
                line = pending.pop(conn)
                if not data:  # closed before asking anything
                    selector.unregister(conn)
                    conn.close()
                    continue
                request = json.loads(line)
                if "preload" in request:
                    selector.unregister(conn)
                    answer(conn, preload(request["preload"]))
                    continue
                code = compiled_script(request)
                if code is None:
                    selector.unregister(conn)
                    answer(conn, {"returncode": 1})
                    continue
                pid = os.fork()
                if pid == 0:
                    child(request, code)
                running[pid] = (conn, request["stdout"])
            elif not data:  # the host gave up on this episode (its wall limit): end the child and its commands
                for pid, (owner, stdout) in list(running.items()):
                    if owner is conn:
                        running[pid] = (None, stdout)  # reaped below, answered to no one
                        try:
                            os.killpg(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                selector.unregister(conn)
                conn.close()
        while running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn, stdout = running.pop(pid, (None, None))
            if stdout is None:
                continue
            if conn is not None:
                selector.unregister(conn)
                answer(conn, {"returncode": os.waitstatus_to_exitcode(status)})
            learn_imports(stdout + ".imports")


if __name__ == "__main__":
    main(sys.argv[1])
