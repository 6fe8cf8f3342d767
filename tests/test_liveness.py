"""A live process can be a dead server: the supervisor's liveness probe (primebuild/runtime/liveness.py) and the
orchestrator's client (primebuild/runtime/orchestrator/client.py) both treat a server that answers only errors as
failing, against a real HTTP server on 127.0.0.1 whose answers the test sets."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from primebuild.runtime import liveness
from primebuild.runtime.orchestrator import client as client_module
from primebuild.runtime.orchestrator.client import InferenceClient, InferenceUnavailable


class Answers(BaseHTTPRequestHandler):
    status = 200  # what every request gets (set by the test)

    def _answer(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        self.rfile.read(length)
        body = json.dumps({"error": {"message": "EngineCore encountered an issue"}}).encode()
        self.server.errors_answered += self.server.status >= 500
        self.send_response(self.server.status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture()
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    httpd.status = 200
    httpd.errors_answered = 0
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()


def _url(httpd) -> str:
    return f"http://127.0.0.1:{httpd.server_address[1]}"


@pytest.fixture()
def quick_probe(monkeypatch):
    """A probe every 0.5 s, not 2 s: what these tests check counts answers in a row, not seconds."""
    monkeypatch.setattr(liveness, "PROBE_SECONDS", 0.5)


def test_the_probe_declares_a_server_answering_errors_dead_and_leaves_a_healthy_one(server, quick_probe):
    probe = liveness.LivenessProbe("inference-0", _url(server) + "/health")
    try:
        time.sleep(liveness.PROBE_SECONDS * (liveness.DEAD_AFTER_ERRORS + 1))
        assert probe.cause is None  # healthy all along
        server.status = 503
        deadline = time.monotonic() + 60
        while probe.cause is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert probe.cause is not None and "answered 503, answered 503, answered 503" in probe.cause
    finally:
        probe.stop()


def test_a_server_that_stops_listening_after_an_error_is_dead_within_seconds(server, quick_probe):
    """vLLM's API server after its EngineCore died: one 503, then it closes its socket and waits for its
    clients' connections, alive but not listening."""
    probe = liveness.LivenessProbe("inference-0", _url(server) + "/health")
    try:
        time.sleep(liveness.PROBE_SECONDS * 2)
        server.status = 503
        deadline = time.monotonic() + 30
        while not server.errors_answered and time.monotonic() < deadline:
            time.sleep(0.05)
        server.shutdown()
        server.server_close()  # nothing listens any more
        deadline = time.monotonic() + 60
        while probe.cause is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert probe.cause is not None and "refused the connection" in probe.cause, probe.cause
        assert time.monotonic() < deadline  # well before UNRESPONSIVE_SECONDS
    finally:
        probe.stop()


def test_the_root_cause_is_the_first_error_since_the_last_start(tmp_path):
    log = tmp_path / "inference-0.log"
    log.write_text("\n".join([
        f"{liveness.START_MARKER}2026-12-03T08:00:00 (restart 0) ---",
        "(Worker pid=1) ERROR [x.py:1] ValueError: from the first life",
        f"{liveness.START_MARKER}2026-12-03T08:10:00 (restart 1) ---",
        "WARNING fd limit errors like `OSError: [Errno 24] Too many open files`",  # not a raised error
        "(Worker pid=2) ERROR 12-03 08:13:02 [multiproc_executor.py:1063] RuntimeError: CPU Generator does not use offset",
        "(APIServer pid=3) ERROR [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: EngineCore died",
    ]) + "\n")
    assert liveness.first_error_line(log) == "RuntimeError: CPU Generator does not use offset"
    # a killed EngineCore leaves only its consequence, with the exception's module path
    log.write_text(f"{liveness.START_MARKER}2026-12-03T09:06:25 (restart 0) ---\n(APIServer pid=4) ERROR 12-03 "
                   "09:09:59 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered "
                   "an issue.\n")
    assert liveness.first_error_line(log) == "EngineDeadError: EngineCore encountered an issue."
    # one of our processes that reports its error itself, after warnings that quote errors of others
    log.write_text(f"{liveness.START_MARKER}2026-12-03T09:06:25 (restart 0) ---\nWARNING rollout group 3 failed "
                   "and is dropped: TaskError: boom\n    | ValueError: boom\nerror: 3 rollout groups failed in a row\n")
    assert liveness.first_error_line(log) == "3 rollout groups failed in a row"
    assert liveness.first_error_line(tmp_path / "missing.log") is None


def test_the_client_gives_up_on_a_server_that_only_answers_errors(server, monkeypatch, caplog):
    monkeypatch.setattr(client_module, "ERROR_RUN_SECONDS", 2.0)
    monkeypatch.setattr(client_module, "QUIET_SECONDS", 0.5)
    server.status = 500

    async def main():
        client = InferenceClient(_url(server) + "/v1", "tiny", retry_seconds=600)
        try:
            await client.complete([5, 6, 7], n=1, temperature=1.0, top_p=1.0, max_tokens=4, seed=1)
        finally:
            await client.close()
        return client

    started = time.monotonic()
    with pytest.raises(InferenceUnavailable, match="answered only 500 .* was not restarted: .*EngineCore"):
        asyncio.run(main())
    assert time.monotonic() - started < 60  # not the 600 s retry window of a server that is restarting
    assert any(r.levelname == "WARNING" and "answered 500" in r.getMessage() for r in caplog.records)
