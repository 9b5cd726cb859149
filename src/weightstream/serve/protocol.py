"""The OpenAI API's request and response shapes for /v1/completions and /v1/chat/completions, and its error object.

Requests are validated by pydantic models (unknown fields are accepted and ignored, as OpenAI-compatible servers
do); fields whose meaning this server cannot honour are refused by name instead of silently ignored. Every field
has its range: a value outside it is a 400 that names the field, never a failure further in.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import time
import uuid

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator

from weightstream.engine.batching.logprobs import TokenLogprob
from weightstream.engine.batching.sequence import Delta, PromptScored
from weightstream.serve.logprobs import TextOffsets

INT64 = 2**63  # seed: OpenAI's range, -2^63 .. 2^63 - 1
LOGIT_BIAS_LIMIT = 100.0  # OpenAI: biases in -100 .. 100
PENALTY_LIMIT = 2.0  # OpenAI: presence_penalty and frequency_penalty in -2 .. 2
MAX_N = 128  # OpenAI: n in 1 .. 128
MAX_COMPLETION_LOGPROBS = 5  # OpenAI: completions' logprobs in 0 .. 5
MAX_TOP_LOGPROBS = 20  # OpenAI: chat's top_logprobs in 0 .. 20
MAX_STOP_STRINGS = 4  # OpenAI: "up to 4 sequences"; more is refused rather than searched for every token
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's; others are a 400


class ApiError(Exception):
    """An OpenAI-style error: HTTP `status` and the body {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers  # extra response headers (Retry-After on a 429)

    @property
    def type(self) -> str:
        # as OpenAI labels them: a wrong key or an unknown model is an invalid request too, told apart by `code`
        if self.status == 429:
            return "rate_limit_error"
        return "server_error" if self.status >= 500 else "invalid_request_error"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _not_a_boolean(value):
    """A JSON true or false where a number belongs is refused: pydantic alone would read it as 1 or 0."""
    if isinstance(value, bool):
        raise ValueError(f"{json.dumps(value)} is a boolean, not a number; send a number")
    return value


_NUMBERS = ("max_tokens", "temperature", "top_p", "seed", "n", "presence_penalty", "frequency_penalty")


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None  # token id (a decimal string) -> bias added to its logit
    presence_penalty: float = Field(0.0, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)
    frequency_penalty: float = Field(0.0, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)

    _numbers_are_not_booleans = field_validator(*_NUMBERS, mode="before")(_not_a_boolean)

    @field_validator("stop")
    @classmethod
    def _at_most_four_stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise ValueError(
                f"{len(stop)} stop strings; at most {MAX_STOP_STRINGS} are allowed (as OpenAI allows); send fewer"
            )
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _token_ids_and_biases(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not re.fullmatch(r"[0-9]{1,18}", key):  # 18 digits: any vocabulary, and int() stays cheap
                raise ValueError(
                    f'key {key[:40]!r} is not a token id; keys are token ids as decimal strings, e.g. {{"1234": -100}}'
                )
            if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:  # NaN fails this too
                raise ValueError(f"token {key}: bias {value} is outside -100..100; send a bias in that range")
        return bias

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(key), value) for key, value in (self.logit_bias or {}).items())


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[TextPart] | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in CHAT_ROLES:
            shown = role if len(role) <= 40 else role[:37] + "..."
            raise ValueError(f"role {shown!r} is not a chat role; use one of {', '.join(CHAT_ROLES)}")
        return role


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens; wins when both are set
    logprobs: StrictBool | None = None  # "yes" or 1 would pass as true otherwise
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    _counts_are_not_booleans = field_validator("max_completion_tokens", "top_logprobs", mode="before")(_not_a_boolean)

    def top_logprobs_wanted(self) -> int | None:
        """Alternatives per token to report (0: the token's own logprob only), or None: no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # the legacy endpoint's default; 0 only with echo (scoring a prompt)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    _counts_are_not_booleans = field_validator("logprobs", "best_of", mode="before")(_not_a_boolean)

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs


# Fields of OpenAI's API that change the answer and that this server cannot honour, each with the values that ask
# for nothing it lacks: any other value is refused by name rather than ignored. Fields that change nothing in the
# answer (user, metadata, store, service_tier, prediction, ...) are accepted and ignored, as unknown fields are.
_CHAT_UNSUPPORTED = (
    ("tools", (None, [])),
    ("tool_choice", (None, "none")),
    ("functions", (None, [])),
    ("function_call", (None, "none")),
    ("parallel_tool_calls", (None,)),
    ("response_format", (None, {"type": "text"})),
    ("audio", (None,)),
    ("modalities", (None, ["text"])),
    ("web_search_options", (None,)),
    ("reasoning_effort", (None,)),
    ("verbosity", (None,)),
)
_COMPLETION_UNSUPPORTED = (("suffix", (None, "")),)


def parse_request(raw: bytes, kind: type[_Request]) -> _Request:
    """The validated request, or a 400 that names the field and what is wrong with it."""
    data = _load_json(raw)
    try:
        request = kind.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        message = first["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"{param}: {message}", param=param) from None
    _refuse_unsupported(request)
    _check_combinations(request)
    return request


def _load_json(raw: bytes) -> dict:
    """The body as a JSON object, or a 400 for anything Python's json cannot turn into one the server can use."""
    try:
        data = json.loads(raw)
        json.dumps(data, ensure_ascii=False).encode()  # a lone surrogate (\ud800) loads, then fails every encoder
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc}); send a JSON object") from None
    except UnicodeEncodeError:
        raise ApiError(
            400,
            "the request body has a lone UTF-16 surrogate escape (\\ud800-\\udfff without its pair), which is not "
            "text; send valid Unicode",
        ) from None
    except ValueError:  # an integer literal past Python's digit limit
        raise ApiError(
            400,
            f"the request body has an integer of more than {sys.get_int_max_str_digits()} digits, which no field "
            "takes; send numbers in each field's range",
        ) from None
    except RecursionError:
        raise ApiError(400, "the request body is JSON nested too deeply to read; send a JSON object") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body is JSON {type(data).__name__}; send a JSON object")
    return data


def _refuse_unsupported(request: _Request) -> None:
    pairs = _CHAT_UNSUPPORTED if isinstance(request, ChatRequest) else _COMPLETION_UNSUPPORTED
    for field, fine in pairs:
        value = getattr(request, field, None)  # declared, or an unknown field the request sent
        if not any(value == ok and type(value) is type(ok) for ok in fine):
            shown = repr(value)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise ApiError(400, f"{field}={shown} is not supported by this server; leave {field} out", param=field)


def _check_combinations(request: _Request) -> None:
    """Fields valid alone that do not go together."""
    if isinstance(request, ChatRequest):
        if request.top_logprobs is not None and not request.logprobs:
            raise ApiError(400, "top_logprobs: it needs logprobs: true; send both, or neither", "top_logprobs")
        return
    if request.max_tokens == 0 and not request.echo:
        raise ApiError(
            400,
            "max_tokens: 0 asks for nothing; it is allowed only with echo: true (to score the prompt, with logprobs)",
            "max_tokens",
        )
    if request.best_of is not None and request.best_of != request.n:
        raise ApiError(
            400,
            f"best_of={request.best_of} with n={request.n} is not supported: this server returns every choice it "
            "samples; leave best_of out or set it to n",
            "best_of",
        )


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


@dataclasses.dataclass(slots=True)
class _Choice:
    echo: str  # the prompt's text when echoed, else ""
    text: list[str] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    offsets: TextOffsets = dataclasses.field(default_factory=TextOffsets)  # a stream's text_offset so far


class Reply:
    """One request's response, built from its choices' events: the whole answer, or its stream chunks. Choices are
    numbered as OpenAI numbers them, prompt-major (prompt i's choice j is i x n + j); `echoes` holds each choice's
    echoed prompt text ("" without echo); `logprobs` formats logprobs (logprobs.py), None when not asked for."""

    def __init__(self, chat: bool, model: str, echoes: list[str], prompt_tokens: int, logprobs=None):
        self.chat, self.model, self.prompt_tokens, self.logprobs = chat, model, prompt_tokens, logprobs
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.choices = [_Choice(echo) for echo in echoes]

    @property
    def complete(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def usage(self) -> dict:
        return usage(self.prompt_tokens, sum(c.completion_tokens for c in self.choices))

    def _envelope(self, obj: str, choices: list, usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def take(self, index: int, event, stream: bool = True) -> list[dict]:
        """Record choice `index`'s event (Delta, PromptScored, Finished); the stream chunks it makes, if `stream`."""
        c = self.choices[index]
        if isinstance(event, PromptScored):
            c.prompt_logprobs = list(event.logprobs)
            return [self._piece(index, c.echo, c.prompt_logprobs)] if stream else []
        if isinstance(event, Delta):
            c.text.append(event.text)
            c.logprobs += event.logprobs
            return [self._piece(index, event.text, event.logprobs)] if stream else []
        c.finish_reason, c.completion_tokens = event.reason, event.completion_tokens
        return [self._chunk(index, {"delta": {}} if self.chat else {"text": ""}, None, event.reason)] if stream else []

    def opening(self) -> list[dict]:
        """The chunks a stream starts with: chat's assistant role, or an echoed prompt whose logprobs are not
        wanted (with logprobs it comes with them, once scored)."""
        if self.chat:
            return [self._chunk(i, {"delta": {"role": "assistant", "content": ""}}) for i in range(len(self.choices))]
        if self.logprobs is None:
            return [self._piece(i, c.echo, []) for i, c in enumerate(self.choices) if c.echo]
        return []

    def _piece(self, index: int, text: str, logprobs: list[TokenLogprob]) -> dict:
        c = self.choices[index]
        shown = None
        if self.logprobs is not None:
            shown = self.logprobs(logprobs, c.offsets)
        content = ({"delta": {"content": text} if text else {}}) if self.chat else {"text": text}
        return self._chunk(index, content, shown)

    def _chunk(self, index: int, content: dict, logprobs=None, finish_reason: str | None = None) -> dict:
        choice = {"index": index, **content, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], self.usage())

    def whole(self) -> dict:
        choices = []
        for i, c in enumerate(self.choices):
            text = c.echo + "".join(c.text)
            shown = None if self.logprobs is None else self.logprobs(c.prompt_logprobs + c.logprobs)
            content = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
            choices.append({"index": i, **content, "logprobs": shown, "finish_reason": c.finish_reason})
        return self._envelope("chat.completion" if self.chat else "text_completion", choices, self.usage())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    total = prompt_tokens + completion_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": total}


def sse(obj: dict | str) -> str:
    """One server-sent event: `data: <json>` (or `data: [DONE]`) and a blank line."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"
