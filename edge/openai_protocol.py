"""The OpenAI API's requests and responses as `specedge edge-serve` reads and writes them (pure functions;
the HTTP side is edge/openai_server.py).

Requests are checked the way the API documents them, and a field that would change the output but that
specedge cannot honour (logprobs, penalties, tools, n > 1, ...) is refused with a 400 naming it rather than
silently ignored; fields that do not change the output (user, metadata, ...) are ignored. Defaults are the
API's: temperature 1, top_p 1, max_tokens 16 for completions and up to the verifier's limit for chat.
`top_k` is accepted as an extension, as vLLM does.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass

from specedge.common.params import SamplingParams

COMPLETION_DEFAULT_MAX_TOKENS = 16  # the API's default for /v1/completions
MAX_STOP_STRINGS = 4  # the API's limit
CHAT_ROLES = {"system", "user", "assistant"}
# Fields that change what is generated, with the values that leave it unchanged.
UNSUPPORTED = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""), "logit_bias": (None, {}), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none"), "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}), "n": (None, 1), "prediction": (None,),
}


class ApiError(Exception):
    """An error answered in the API's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Limits:
    served_model: str
    max_prompt_tokens: int
    max_new_tokens: int


@dataclass
class Request:
    chat: bool
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool  # streaming: a last chunk with the usage counts


def parse_request(body, chat: bool, tokenizer, limits: Limits) -> Request:
    """A /v1/chat/completions (chat) or /v1/completions body -> Request; ApiError when it is not valid."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise ApiError(400, "`model` is required (a string)", "model")
    if model != limits.served_model:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves `{limits.served_model}`",
                       "model", "invalid_request_error", "model_not_found")
    for name, neutral in UNSUPPORTED.items():
        if name in body and body[name] not in neutral:
            raise ApiError(400, f"`{name}` is not supported by specedge (leave it out)", name)
    prompt_ids = _chat_ids(body, tokenizer) if chat else _completion_ids(body, tokenizer)
    if len(prompt_ids) > limits.max_prompt_tokens:
        raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens; this server takes at most "
                       f"{limits.max_prompt_tokens}", "messages" if chat else "prompt")
    max_tokens = _max_tokens(body, chat, limits)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise ApiError(400, "`top_p` must be > 0", "top_p")
    top_k = _integer(body, "top_k", 0, -1, None)
    seed = _integer(body, "seed", None, 0, 2**64 - 1)
    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=max(top_k, 0), seed=seed,
                                max_new_tokens=max_tokens, stop=_stop(body))
    except ValueError as e:
        raise ApiError(400, str(e))
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise ApiError(400, "`stream` must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise ApiError(400, "`stream_options` must be an object like {\"include_usage\": true}", "stream_options")
    return Request(chat, prompt_ids, params, stream, bool(options.get("include_usage")))


def _completion_ids(body: dict, tokenizer) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)  # token ids, checked against the vocabulary by the verifier
    if isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError(400, "one prompt per request: send a batch as separate requests (they share the verifier's "
                       "batches anyway)", "prompt")
    raise ApiError(400, "`prompt` must be a non-empty string or a list of token ids", "prompt")


def _chat_ids(body: dict, tokenizer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "`messages` must be a non-empty list", "messages")
    turns = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        role = "system" if role == "developer" else role
        if role not in CHAT_ROLES:
            raise ApiError(400, f"messages[{i}]: role must be one of system, developer, user, assistant "
                           f"(tools are not supported), got {role!r}", "messages")
        turns.append({"role": role, "content": _text_content(m.get("content"), i)})
    try:
        return tokenizer.encode_chat(turns)
    except ValueError as e:  # no chat template
        raise ApiError(400, str(e), "messages")
    except Exception as e:  # the template refused the conversation (jinja's raise_exception)
        if type(e).__module__.startswith("jinja2"):
            raise ApiError(400, f"the model's chat template refused these messages: {e}", "messages")
        raise


def _text_content(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")


def _max_tokens(body: dict, chat: bool, limits: Limits) -> int:
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    default = limits.max_new_tokens if chat else min(COMPLETION_DEFAULT_MAX_TOKENS, limits.max_new_tokens)
    value = _integer(body, name, default, 1, None)
    if value > limits.max_new_tokens:
        raise ApiError(400, f"`{name}` is {value}; this server generates at most {limits.max_new_tokens} tokens "
                       "per request", name)
    return value


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise ApiError(400, f"`{name}` must be a number in [{low:g}, {high:g}], got {value!r}", name)
    return float(value)


def _integer(body: dict, name: str, default, low: int, high: int | None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ApiError(400, f"`{name}` must be an integer {bounds}, got {value!r}", name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) \
            or len(stops) > MAX_STOP_STRINGS:
        raise ApiError(400, f"`stop` must be a non-empty string or a list of up to {MAX_STOP_STRINGS} of them", "stop")
    return tuple(stops)


def finish_reason(stopped_by: str) -> str:
    """The API's name for why generation ended: "length" at max_tokens, "stop" otherwise (EOS, stop string)."""
    return "length" if stopped_by == "max_new_tokens" else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Response:
    """The id, creation time and model that every object of one answer carries, and the objects."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _object(self, kind: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def whole(self, text: str, reason: str, counts: dict, stats: dict) -> dict:
        """The non-streamed answer; `stats` (specedge's rounds and speeds) go under the key "specedge"."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason}
            return self._object("chat.completion", [choice], usage=counts, specedge=stats)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return self._object("text_completion", [choice], usage=counts, specedge=stats)

    def chunk(self, text: str | None = None, reason: str | None = None, first: bool = False) -> dict:
        """A streamed piece (chat: the first chunk also carries the assistant role)."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            return self._object("chat.completion.chunk", [choice])
        return self._object("text_completion", [{"index": 0, "text": text or "", "logprobs": None,
                                                 "finish_reason": reason}])

    def usage_chunk(self, counts: dict) -> dict:
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [], usage=counts)
