"""The OpenAI wire format: request bodies checked into a Call, and the response and chunk bodies.

Every field a client may send is either used, accepted at its neutral value only (e.g. presence_penalty 0),
or refused with a BadRequest naming it: nothing a client asks for is silently ignored. The verification
dial travels as extra body fields (what the openai client sends through `extra_body`): `verification`, a
rule as `--verification` spells it (a head's strictness shift included: `diversed:gsm8k@+1`), `head`, the name
of a head the server loaded, and `draft_length`, a cap on the drafts per round for this request.
`prediction` is OpenAI's Predicted Outputs, on both endpoints. `provenance: true` (an extension, off by default)
adds to each choice, and to each streamed chunk's choice, `provenance`: how each new token was made
(diversed.decoding.provenance.records).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from diversed.request import DRAFTERS, RequestError, Sampling, Verification, check_encodable


class BadRequest(Exception):
    """A request the server refuses, with OpenAI's error fields: the message, the offending parameter and
    a code; `status` is the HTTP status."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return error_body(self.message, kind, self.param, self.code)


# The request's own names (diversed.request) that OpenAI's API spells otherwise.
_OPENAI_NAMES = {"max_new_tokens": "max_tokens"}


def request_error(error: RequestError, chat: bool) -> tuple[str, str]:
    """A request module's error as this API says it: the message with the body field's name, and the field."""
    param = "messages" if error.field == "prompt" and chat else _OPENAI_NAMES.get(error.field, error.field)
    return error.message_for(param), param


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class Call:
    """A checked completion request: the prompt (text, or chat messages), how to decode it, how to reply."""

    chat: bool
    prompt: str | list[dict]
    verification: Verification
    head: str | None
    sampling: Sampling
    max_tokens: int | None
    stop: tuple[str, ...]
    seed: int | None
    draft_length: int | None
    drafter: str | None
    stream: bool
    include_usage: bool
    model: str | None
    prediction: str | None  # Predicted Outputs' content
    provenance: bool


# Fields accepted only at the value that changes nothing (OpenAI's defaults): on both endpoints, then on one.
_NEUTRAL = {"presence_penalty": (0, 0.0, None), "frequency_penalty": (0, 0.0, None), "logprobs": (None, False, 0),
            "logit_bias": (None, {}), "n": (1, None)}
_ENDPOINT_NEUTRAL = {
    False: {"echo": (False, None), "best_of": (1, None), "suffix": (None, "")},
    True: {"top_logprobs": (None, 0), "tools": (None, []), "tool_choice": (None, "none"),
           "parallel_tool_calls": (None,), "response_format": (None, {"type": "text"})},
}
# Bookkeeping fields that do not change the output, with the type each must have.
_IGNORED = {"user": (str, "a string"), "metadata": (dict, "an object"), "store": (bool, "true or false"),
            "service_tier": (str, "a string")}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream", "stream_options",
           "verification", "head", "draft_length", "drafter", "prediction", "provenance", *_NEUTRAL, *_IGNORED}
_FIELDS = {False: _COMMON | {"prompt", *_ENDPOINT_NEUTRAL[False]},
           True: _COMMON | {"messages", "max_completion_tokens", *_ENDPOINT_NEUTRAL[True]}}
_ROLES = ("system", "user", "assistant", "developer")


def parse_call(body, chat: bool, default_verification: Verification) -> Call:
    """Check a /v1/completions (chat=False) or /v1/chat/completions body; BadRequest names the field."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - _FIELDS[chat])
    if unknown:
        raise BadRequest(f"unrecognized request argument: {unknown[0]}", unknown[0], "unknown_parameter")
    for name, neutral in (_NEUTRAL | _ENDPOINT_NEUTRAL[chat]).items():
        if name in body and not any(body[name] == v and type(body[name]) is type(v) for v in neutral):
            raise BadRequest(f"this server does not support {name} = {body[name]!r}; leave {name} out", name,
                             "unsupported_parameter")
    for name, (kind, what) in _IGNORED.items():
        if body.get(name) is not None and not isinstance(body[name], kind):
            raise BadRequest(f"{name} must be {what}, got {body[name]!r}", name)
    prompt = _messages(body) if chat else _prompt(body)
    verification, head = _verification(body, default_verification)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise BadRequest("top_p must be in (0, 1]", "top_p")
    top_k = _integer(body, "top_k", 0, 0)
    max_tokens = _integer(body, "max_tokens", None if chat else 16, 1)
    if chat and (completion_tokens := _integer(body, "max_completion_tokens", None, 1)) is not None:
        if max_tokens not in (None, completion_tokens):
            raise BadRequest(f"max_tokens ({max_tokens}) and max_completion_tokens ({completion_tokens}) disagree: "
                             "send one", "max_completion_tokens")
        max_tokens = completion_tokens
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise BadRequest("stream_options must be an object with at most include_usage", "stream_options")
    if options is not None and not stream:
        raise BadRequest("stream_options is only allowed with stream: true", "stream_options")
    include_usage = _flag(options or {}, "include_usage", "stream_options.include_usage")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model must be a string", "model")
    return Call(chat, prompt, verification, head, Sampling(temperature, top_k, top_p), max_tokens, _stop(body),
                _integer(body, "seed", None, 0), _integer(body, "draft_length", None, 1), _drafter(body),
                stream, include_usage, model, _prediction(body), _flag(body, "provenance"))


def _prediction(body: dict) -> str | None:
    """OpenAI's Predicted Outputs: {"type": "content", "content": text or a list of text parts}."""
    prediction = body.get("prediction")
    if prediction is None:
        return None
    if not isinstance(prediction, dict) or set(prediction) != {"type", "content"} or prediction["type"] != "content":
        raise BadRequest('prediction must be an object {"type": "content", "content": text}', "prediction")
    content = prediction["content"]
    if isinstance(content, list):  # content parts: text parts only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise BadRequest("prediction.content may hold only text parts", "prediction.content")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise BadRequest("prediction.content must be a string or a list of text parts", "prediction.content")
    return _encodable("prediction.content", content)


def _drafter(body: dict) -> str | None:
    drafter = body.get("drafter")
    if drafter is not None and drafter not in DRAFTERS:
        raise BadRequest(f"drafter must be one of {list(DRAFTERS)}", "drafter")
    return drafter


def _prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise BadRequest("prompt must be a string (one prompt a request)", "prompt")
    if not prompt:
        raise BadRequest("prompt is empty", "prompt")
    return _encodable("prompt", prompt)


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects", "messages")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            raise BadRequest(f"messages[{i}] must be an object with a role in {list(_ROLES)}", f"messages[{i}].role")
        # A message passed back from a response carries its empty fields (refusal: null, tool_calls: null):
        # those change nothing; any other field (name, tool_calls, ...) the template would drop.
        extra = sorted(k for k, v in message.items() if k not in ("role", "content") and v not in (None, []))
        if extra:
            raise BadRequest(f"this server does not support messages[{i}].{extra[0]}; leave it out",
                             f"messages[{i}].{extra[0]}", "unsupported_parameter")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text parts only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest(f"messages[{i}].content may hold only text parts", f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string", f"messages[{i}].content")
        checked.append({"role": "system" if message["role"] == "developer" else message["role"],
                        "content": _encodable(f"messages[{i}].content", content)})
    return checked


def _encodable(param: str, text: str) -> str:
    try:
        check_encodable(param, text)
    except ValueError as error:
        raise BadRequest(str(error), param) from None
    return text


def _verification(body: dict, default: Verification) -> tuple[Verification, str | None]:
    text = body.get("verification")
    head = body.get("head")
    if head is not None and not isinstance(head, str):
        raise BadRequest("head must be the name of a loaded head", "head")
    if text is None:  # the server's rule; a head alone asks for "diversed" (with the server's shift, if it has one)
        verification = default if head is None or default.name == "diversed" else Verification("diversed")
    else:
        if not isinstance(text, str):
            raise BadRequest("verification must be a string such as 'exact', 'static:0.7' or 'diversed'",
                             "verification")
        try:
            verification = Verification.parse(text)
        except RequestError as error:
            raise BadRequest(*request_error(error, chat=False)) from None
        if verification.head is not None:  # the head by name: a client never names a folder on the server
            if head not in (None, verification.head):
                raise BadRequest(f"verification {text!r} names head {verification.head!r} and head names {head!r}: "
                                 "name one", "head")
            head = verification.head
        if verification.name == "dynamic":
            raise BadRequest("verification 'dynamic' needs a weight function: use 'diversed' with a head",
                             "verification")
    if head is not None and verification.name != "diversed":
        raise BadRequest(f"head is for verification 'diversed', not {verification.label!r}", "head")
    return verification, head


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    # The range test refuses NaN and infinity too, and compares an integer of any size without overflow.
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise BadRequest(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}", name)
    return float(value)


def _integer(body: dict, name: str, default: int | None, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < 2**63:
        raise BadRequest(f"{name} must be an integer >= {low}, got {value!r}", name)
    return value


def _flag(body: dict, name: str, param: str | None = None) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"{param or name} must be true or false", param or name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, list | tuple) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a non-empty string or a list of at most 4 of them", "stop")
    return tuple(_encodable("stop", s) for s in stop)


FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}


@dataclass
class Reply:
    """The response envelope of one call: id, time, model and object kinds. include_usage: streamed chunks
    carry "usage": null until the usage chunk (OpenAI's stream_options.include_usage)."""

    chat: bool
    model: str
    include_usage: bool = False
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def whole(self, text: str, finish_reason: str, usage: dict, speculative: dict,
              provenance: list[dict] | None = None) -> dict:
        """The non-streamed response; provenance: the tokens' records, where the request asked for them."""
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                   "finish_reason": finish_reason} if self.chat else
                  {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason})
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self._envelope(kind, [_with(choice, provenance)]), "usage": usage, "speculative": speculative}

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False,
              provenance: list[dict] | None = None) -> dict:
        """One streamed chunk: new text, on the last the finish reason, and the records of the tokens decoded
        since the last chunk where the request asked for them (their text may come in a later chunk)."""
        if self.chat:
            delta = ({"role": "assistant", "content": ""} if first else {}) | \
                ({"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("chat.completion.chunk", [_with(choice, provenance)])
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("text_completion", [_with(choice, provenance)])
        return body | {"usage": None} if self.include_usage else body

    def usage_chunk(self, usage: dict, speculative: dict) -> dict:
        """The chunk after the last, with usage (stream_options.include_usage) and no choices."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(kind, []), "usage": usage, "speculative": speculative}


def _with(choice: dict, provenance: list[dict] | None) -> dict:
    return choice if provenance is None else {**choice, "provenance": provenance}


def usage(prompt_tokens: int, completion_tokens: int, prediction: tuple[int, int] | None = None) -> dict:
    """OpenAI's usage object; with a prediction's (accepted, rejected) tokens, its completion_tokens_details."""
    counts = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
              "total_tokens": prompt_tokens + completion_tokens}
    if prediction is not None:
        counts["completion_tokens_details"] = {"accepted_prediction_tokens": prediction[0],
                                               "rejected_prediction_tokens": prediction[1]}
    return counts
