"""The OpenAI API's request and response shapes for /v1/completions and /v1/chat/completions, and its error object.

Requests are validated by pydantic models (unknown fields are accepted and ignored, as OpenAI-compatible servers
do); fields whose meaning this server cannot honour are refused by name instead of silently ignored.
"""

from __future__ import annotations

import json
import time
import uuid

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class ApiError(Exception):
    """An OpenAI-style error: HTTP `status` and the body {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        # as OpenAI labels them: a wrong key or an unknown model is an invalid request too, told apart by `code`
        return "server_error" if self.status >= 500 else "invalid_request_error"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[TextPart] | None = None


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens; wins when both are set
    logprobs: bool | None = None
    tools: list | None = None
    response_format: dict | None = None


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # the legacy endpoint's default
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


# (field, value that is fine) for fields a request may send but this server cannot honour otherwise
_CHAT_UNSUPPORTED = (("n", 1), ("logprobs", None), ("tools", None), ("response_format", None))
_COMPLETION_UNSUPPORTED = (("n", 1), ("echo", False), ("logprobs", None), ("best_of", None), ("suffix", None))


def parse_request(raw: bytes, kind: type[_Request]) -> _Request:
    """The validated request, or a 400 that names the field and what is wrong with it."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc}); send a JSON object") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body is JSON {type(data).__name__}; send a JSON object")
    try:
        request = kind.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise ApiError(400, f"{param}: {first['msg']}", param=param) from None
    _refuse_unsupported(request, data)
    return request


def _refuse_unsupported(request: _Request, data: dict) -> None:
    pairs = _CHAT_UNSUPPORTED if isinstance(request, ChatRequest) else _COMPLETION_UNSUPPORTED
    for field, fine in pairs:
        value = getattr(request, field)
        if value != fine and not (field == "logprobs" and value is False):
            raise ApiError(400, f"{field}={value!r} is not supported by this server; leave it out", param=field)
    if isinstance(request, ChatRequest) and request.response_format not in (None, {"type": "text"}):
        raise ApiError(400, "response_format is not supported by this server; leave it out", "response_format")


def message_dicts(request: ChatRequest) -> list[dict]:
    """Messages as the chat template takes them: role and text content (text parts joined)."""
    out = []
    for i, m in enumerate(request.messages):
        content = m.content
        if isinstance(content, list):
            if any(p.type != "text" for p in content):
                raise ApiError(400, f"messages.{i}.content: only text parts are supported", f"messages.{i}.content")
            content = "".join(p.text or "" for p in content)
        out.append({"role": m.role, "content": content or ""})
    return out


class Reply:
    """Builds one request's response objects: the whole answer, or its stream chunks."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list, usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def whole(self, text: str, finish_reason: str, usage: dict) -> dict:
        if self.chat:
            choice = {"message": {"role": "assistant", "content": text}}
            return self._envelope("chat.completion", [self._choice(choice, finish_reason)], usage)
        return self._envelope("text_completion", [self._choice({"text": text}, finish_reason)], usage)

    def chunk(self, text: str | None = None, finish_reason: str | None = None, role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            return self._envelope("chat.completion.chunk", [self._choice({"delta": delta}, finish_reason)])
        return self._envelope("text_completion", [self._choice({"text": text or ""}, finish_reason)])

    def usage_chunk(self, usage: dict) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], usage)

    @staticmethod
    def _choice(content: dict, finish_reason: str | None) -> dict:
        return {"index": 0, **content, "logprobs": None, "finish_reason": finish_reason}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    total = prompt_tokens + completion_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": total}


def sse(obj: dict | str) -> str:
    """One server-sent event: `data: <json>` (or `data: [DONE]`) and a blank line."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"
