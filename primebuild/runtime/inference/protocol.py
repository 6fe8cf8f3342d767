"""OpenAI request bodies (with the extensions RL needs) and OpenAI-shaped errors.

Bodies are parsed by hand (not by FastAPI) so that every malformed input becomes a 4xx in OpenAI's
error shape, `{"error": {"message", "type", "param", "code"}}`, never a 422 in another shape or a 500.
Unknown fields are ignored, as the OpenAI API does for fields a client library adds.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

if TYPE_CHECKING:  # imported where used: body_parser.py's child process parses bodies without torch
    from .sampling import SamplingParams

MAX_BODY_BYTES = 32 * 1024 * 1024
MAX_STOP_STRINGS = 4  # OpenAI's limit, and vLLM's
MAX_TOP_LOGPROBS = 20

Int64 = Annotated[int, Field(ge=-(2**63), lt=2**64)]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]


class ApiError(Exception):
    """An error that becomes an HTTP response with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind or ("invalid_request_error" if status < 500 else "internal_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def __reduce__(self):  # crosses the pipe from body_parser.py's child process
        return _api_error, (self.status, self.message, self.param, self.code, self.kind)


def _api_error(status, message, param, code, kind) -> ApiError:
    return ApiError(status, message, param=param, code=code, kind=kind)


def authorize(request, admin_token: str | None) -> str:
    """The request's Authorization header, when it carries the run's admin token (else 401). Admin calls
    need it, and so does a body with `kv_transfer`, which only the P/D router may send."""
    import hmac

    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if (not admin_token or scheme.lower() != "bearer"
            or not hmac.compare_digest(given.strip().encode(), admin_token.encode())):
        raise ApiError(401, "admin calls need 'Authorization: Bearer <admin token>'", code="unauthorized",
                       kind="authentication_error")
    return header


def answer_errors_in_openai_shape(app) -> None:
    """A FastAPI app's ApiErrors, and Starlette's own 404/405 (an unknown route or method), as OpenAI's
    error body: clients of the server and of the routers parse one shape."""
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    @app.exception_handler(ApiError)
    async def _api_error(request, err: ApiError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)
    async def _http_error(request, err: HTTPException):
        return JSONResponse(ApiError(err.status_code, str(err.detail)).body(), status_code=err.status_code)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class KvTransfer(_Body):
    """P/D (set by the router): on a prefill server `to` is the decode server's KV inbox, and the prompts'
    KV caches go there under `id`; on a decode server the request continues from the KV shipped as `id`."""

    id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    to: str | None = Field(None, pattern=r"^tcp://[A-Za-z0-9.:\[\]-]{1,255}:[0-9]{1,5}$")


class CommonRequest(_Body):
    model: str
    max_tokens: int | None = Field(None, ge=1, lt=2**31)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1, lt=2**31)
    n: int | None = Field(None, ge=1, lt=2**31)
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, allow_inf_nan=False)
    return_routed_experts: bool = False
    kv_transfer: KvTransfer | None = None

    # OpenAI and vLLM answer 400 to these two; an ApiError passes through pydantic with its param
    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> CommonRequest:
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
        return self

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ApiError(400, f"stop: give at most {MAX_STOP_STRINGS} non-empty strings", param="stop")
        return stops

    def sampling(self, max_tokens: int, top_logprobs: int) -> SamplingParams:
        from .sampling import SamplingParams

        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise ApiError(400, f"{name} is not supported by this engine (use 0)", param=name)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            seed=self.seed,
            n=self.n or 1,
            stop=self.stop_list(),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            top_logprobs=top_logprobs,
            return_routed_experts=self.return_routed_experts,
        )


class CompletionRequest(CommonRequest):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    # vLLM's extension: each choice also gets `prompt_logprobs`, None for the first prompt token, then
    # {token id: {"logprob": x}} for each later one. Only 0 (the prompt's own tokens, no alternatives).
    prompt_logprobs: int | None = Field(None, ge=0, le=0)


class ContentPart(_Body):
    type: str
    text: str | None = None


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionSpec(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None


class ToolSpec(_Body):
    type: Literal["function"]
    function: FunctionSpec


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result: the call it answers
    name: str | None = None

    def template_input(self) -> dict:
        """The message as a chat template reads it (OpenAI's keys, only those given)."""
        message: dict = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        if any(part.type != "text" or part.text is None for part in self.content):
            raise ApiError(400, "only text content parts are supported", param="messages")
        return "".join(part.text for part in self.content)


class ChatRequest(CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1, lt=2**31)
    add_generation_prompt: bool = True
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto"] | None = None  # "required" and named choices need guided decoding

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return self

    def template_tools(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


class UpdateWeightsRequest(_Body):
    path: str | None = Field(None, min_length=1)  # an HF step folder, for source "folder"
    version: Annotated[int, Field(ge=0, lt=2**63)]  # a policy version: the trainer's step
    in_flight: Literal["resume", "finish"] = "resume"
    source: Literal["folder", "broadcast"] = "folder"  # broadcast: the weights this server has staged

    @model_validator(mode="after")
    def _folder_needs_path(self) -> UpdateWeightsRequest:
        if self.source == "folder" and self.path is None:
            raise ValueError("path: a step folder is required unless source is 'broadcast'")
        return self


async def read_body(request, limit: int = MAX_BODY_BYTES) -> bytes:
    """A request's body (a Starlette Request), refused with 413 as soon as it passes `limit` (a body read
    whole before the check let one client make the server hold gigabytes)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body larger than {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body larger than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_body(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """Bytes -> validated request, or an ApiError(400) that says what is wrong and where."""
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body larger than {MAX_BODY_BYTES} bytes")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as err:  # bad UTF-8, bad JSON, absurd nesting
        raise ApiError(400, f"request body is not valid JSON: {str(err)[:200]}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in _input_path(data, first["loc"])) or None
        message = first["msg"].removeprefix("Value error, ")
        named, _, rest = message.partition(": ")  # a check across fields names its field first ("path: ...")
        if where is None and rest and named in model.model_fields:
            where, message = named, rest
        raise ApiError(400, f"{where}: {message}" if where else message, param=where) from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply") from None


def _input_path(data, loc: tuple) -> list:
    """The part of a pydantic error location that exists in the request: ("prompt", "str") -> ["prompt"]
    (a union's member names are no parameter a client could fix)."""
    path, node = [], data
    for part in loc:
        if isinstance(node, dict) and part in node or isinstance(node, list) and isinstance(part, int) \
                and 0 <= part < len(node):
            path.append(part)
            node = node[part]
        else:
            return path if path else [part]
    return path
