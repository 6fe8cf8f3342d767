"""Request bodies parsed without stalling other clients: small ones inline, large ones in a child process.

`json.loads` and pydantic validate a body in one call that holds the GIL throughout: a 30 MB body held it
for ~2.5 s here (10 M token ids), and with it the event loop and the engine thread, so every other
client stalled. Bodies above INLINE_BYTES are therefore parsed in a child process (this module, run as
`python -m`; it imports pydantic and protocol.py, not torch), which also applies the size checks that
need no tokenizer, so that what comes back is small: prompts no model could take are refused there.

    python -m primebuild.runtime.inference.body_parser   # the child: length-prefixed pickles on stdin/stdout
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO

from pydantic import BaseModel

from .protocol import ApiError, ChatRequest, parse_body

INLINE_BYTES = 1 << 20  # ~40 ms of parsing here: below that a child process costs more than it saves
MAX_PROMPTS = 1024
_FRAME = struct.Struct("<Q")


@dataclass(frozen=True)
class PromptBounds:
    """What the served model can take, for checks before tokenisation."""

    max_model_len: int
    max_chars_per_token: int  # no token covers more characters (vLLM's bound on text before tokenising)

    @property
    def max_chars(self) -> int:
        return self.max_model_len * self.max_chars_per_token


def too_long(bounds: PromptBounds, what: str, size: str, param: str) -> ApiError:
    return ApiError(400, f"This model's maximum context length is {bounds.max_model_len} tokens; {what} has "
                    f"{size}, which leaves no room for a completion.", param=param, code="context_length_exceeded")


def check_sizes(request: BaseModel, bounds: PromptBounds) -> None:
    """Refuse prompts that cannot fit, before anything is tokenised (a 30 MB text took 260 s to tokenise)."""
    if isinstance(request, ChatRequest):
        chars = sum(len(m.text()) for m in request.messages)
        if chars > bounds.max_chars:
            raise too_long(bounds, "the conversation", f"{chars} characters (more than {bounds.max_chars}, the "
                           f"most {bounds.max_model_len} tokens can hold)", "messages")
        return
    prompt = request.prompt
    if isinstance(prompt, str) or (prompt and not isinstance(prompt[0], int)):
        prompts = [prompt] if isinstance(prompt, str) else prompt
    else:
        prompts = [prompt]
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(400, f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    for p in prompts:
        if isinstance(p, str) and len(p) > bounds.max_chars:
            raise too_long(bounds, "the prompt", f"{len(p)} characters (more than {bounds.max_chars}, the most "
                           f"{bounds.max_model_len} tokens can hold)", "prompt")
        if not isinstance(p, str) and len(p) >= bounds.max_model_len:
            raise too_long(bounds, "the prompt", f"{len(p)} tokens", "prompt")


def parse_checked(raw: bytes, model: type[BaseModel], bounds: PromptBounds) -> BaseModel:
    request = parse_body(raw, model)
    check_sizes(request, bounds)
    return request


class BodyParser:
    """One per app; the child process starts at the first large body and parses one body at a time, fed
    by a thread of its own (large bodies queue there, never in the event loop's default executor)."""

    def __init__(self, bounds: PromptBounds):
        self.bounds = bounds
        self._child: subprocess.Popen | None = None
        self._feeder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="body-parser")

    async def parse(self, raw: bytes, model: type[BaseModel]) -> BaseModel:
        if len(raw) <= INLINE_BYTES:
            return parse_checked(raw, model, self.bounds)
        return await asyncio.get_running_loop().run_in_executor(self._feeder, self._in_child, raw, model)

    def _in_child(self, raw: bytes, model: type[BaseModel]) -> BaseModel:
        if self._child is None or self._child.poll() is not None:
            self._child = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE)
        try:
            _write(self._child.stdin, pickle.dumps((raw, model, self.bounds)))
            ok, value = pickle.loads(_read(self._child.stdout))
        except (OSError, EOFError, pickle.UnpicklingError):
            self._stop()
            raise ApiError(500, "the request body parser failed") from None
        if not ok:
            raise value
        return value

    def _stop(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            with contextlib.suppress(OSError):
                child.stdin.close()
            try:
                child.wait(5)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(5)

    def close(self) -> None:
        self._feeder.submit(self._stop).result()
        self._feeder.shutdown()


def _write(stream: BinaryIO, payload: bytes) -> None:
    stream.write(_FRAME.pack(len(payload)) + payload)
    stream.flush()


def _read(stream: BinaryIO) -> bytes:
    header = stream.read(_FRAME.size)
    if len(header) < _FRAME.size:
        raise EOFError
    payload = stream.read(_FRAME.unpack(header)[0])
    if len(payload) < _FRAME.unpack(header)[0]:
        raise EOFError
    return payload


def main() -> None:
    """The child: parse each framed (body, model, bounds) and answer (True, request) or (False, ApiError)."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            raw, model, bounds = pickle.loads(_read(stdin))
        except EOFError:  # the server closed the pipe (or died): nothing more to parse
            return
        try:
            answer = (True, parse_checked(raw, model, bounds))
        except ApiError as err:
            answer = (False, err)
        except Exception as err:  # a bug here must not leave the server without a parser
            answer = (False, ApiError(500, f"internal error parsing the body: {type(err).__name__}"))
        _write(stdout, pickle.dumps(answer))


if __name__ == "__main__":
    main()
