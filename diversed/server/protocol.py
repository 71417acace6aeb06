"""The OpenAI wire format: request bodies translated into a Request (diversed.request, which checks every
field of it), and the response and chunk bodies.

Every field a client may send is either used, accepted at its neutral value only (e.g. presence_penalty 0),
or refused with a BadRequest naming it: nothing a client asks for is silently ignored. This module checks the
wire's own shapes (an object where one is due, the fields it knows, content parts); the values themselves are
the Request's to check. The verification
dial travels as extra body fields (what the openai client sends through `extra_body`): `verification`, a
rule as `--verification` spells it (a head's strictness shift included: `diversed:gsm8k@+1`), `head`, the name
of a head the server loaded, and `max_drafts`, a cap on the drafts per round for this request (`draft_length`,
its name until this release, still works).
`prediction` is OpenAI's Predicted Outputs, on both endpoints. `cache_prompt` (llama-server's field, default
true) starts from what the prompt cache holds of the prompt; usage.prompt_tokens_details.cached_tokens counts
it. `provenance: true` (an extension, off by default) adds to each choice, and to each streamed chunk's
choice, `provenance`: how each new token was made (diversed.decoding.provenance.records).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from diversed.request import Drafting, Request, RequestError, Sampling, Verification


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
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "predictions": "prediction"}


def request_error(error: RequestError, chat: bool) -> tuple[str, str]:
    """A request module's error as this API says it: the message with the body field's name, and the field."""
    param = "messages" if error.field == "prompt" and chat else _OPENAI_NAMES.get(error.field, error.field)
    return error.message_for(param), param


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class Call:
    """A completion request as the server runs it: the Request, and how to reply (the endpoint, streaming,
    usage in the stream, the model the client named). max_tokens_set: whether the body set a limit (else the
    server's own may cap it); head_field: the body field that named the head ("head" or "verification")."""

    request: Request
    chat: bool
    stream: bool
    include_usage: bool
    model: str | None
    max_tokens_set: bool
    head_field: str = "verification"


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
           "verification", "head", "max_drafts", "draft_length", "drafter", "prediction", "provenance", "cache_prompt",
           *_NEUTRAL,
           *_IGNORED}
_FIELDS = {False: _COMMON | {"prompt", *_ENDPOINT_NEUTRAL[False]},
           True: _COMMON | {"messages", "max_completion_tokens", *_ENDPOINT_NEUTRAL[True]}}
_ROLES = ("system", "user", "assistant", "developer")


def parse_call(body, chat: bool, verification: Verification, drafting: Drafting, drafter: str) -> Call:
    """A /v1/completions (chat=False) or /v1/chat/completions body as a Call; BadRequest names a field the wire
    format refuses, RequestError one the request does. verification, drafting, drafter: the server's, for a
    request that sets none."""
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
    max_tokens = _given(body, "max_tokens", None if chat else 16)
    if chat and (completion_tokens := body.get("max_completion_tokens")) is not None:
        if max_tokens is None:
            max_tokens = completion_tokens  # (each checked as the request's max_new_tokens)
        elif max_tokens != completion_tokens and _integers(max_tokens, completion_tokens):
            raise BadRequest(f"max_tokens ({max_tokens}) and max_completion_tokens ({completion_tokens}) disagree: "
                             "send one", "max_completion_tokens")
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
    prompt = _messages(body) if chat else _prompt(body)
    try:
        request = Request((prompt,) if chat and isinstance(prompt, list) else prompt,
                          _verification(body, verification),
                          Sampling(_given(body, "temperature", 1.0), _given(body, "top_k", 0),
                                   _given(body, "top_p", 1.0)),
                          _given(body, "drafter", drafter), drafting, _max_drafts(body), max_tokens,
                          _given(body, "stop", ()), body.get("seed"), _prediction(body),
                          _given(body, "provenance", False), chat, cache_prompt=_given(body, "cache_prompt", True))
    except RequestError as error:
        if error.field == "max_new_tokens" and body.get("max_tokens") is None and chat:  # sent under its new name
            raise BadRequest(error.message_for("max_completion_tokens"), "max_completion_tokens") from error
        raise
    return Call(request, chat, stream, include_usage, model, max_tokens is not None,
                "head" if body.get("head") is not None else "verification")


def _max_drafts(body: dict):
    """max_drafts, or draft_length, its name until this release (one of them)."""
    if body.get("draft_length") is not None and body.get("max_drafts") is not None:
        raise BadRequest("draft_length is max_drafts' old name: send max_drafts", "draft_length")
    return _given(body, "max_drafts", body.get("draft_length"))


def _integers(*values) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def _given(body: dict, name: str, default):
    """A body field as sent, or the default where it is missing or null."""
    value = body.get(name)
    return default if value is None else value


def _prediction(body: dict) -> str | None:
    """OpenAI's Predicted Outputs: {"type": "content", "content": text or a list of text parts}."""
    prediction = body.get("prediction")
    if prediction is None:
        return None
    if not isinstance(prediction, dict) or set(prediction) != {"type", "content"} or prediction["type"] != "content":
        raise BadRequest('prediction must be an object {"type": "content", "content": text}', "prediction")
    return _text(prediction["content"], "prediction.content")


def _prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, list):
        raise BadRequest("prompt must be a string (one prompt a request)", "prompt")
    return prompt


def _messages(body: dict) -> list[dict]:
    """The chat messages as the request's conversation: "developer" is "system", content parts joined."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise BadRequest("messages must be a list of {role, content} objects", "messages")
    conversation = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"messages[{i}] must be an object with a role and content", f"messages[{i}]")
        # A message passed back from a response carries its empty fields (refusal: null, tool_calls: null):
        # those change nothing; any other field (name, tool_calls, ...) the template would drop.
        extra = sorted(k for k, v in message.items() if k not in ("role", "content") and v not in (None, []))
        if extra:
            raise BadRequest(f"this server does not support messages[{i}].{extra[0]}; leave it out",
                             f"messages[{i}].{extra[0]}", "unsupported_parameter")
        role = message.get("role")
        conversation.append({"role": "system" if role == "developer" else role,
                             "content": _text(message.get("content"), f"messages[{i}].content")})
    return conversation


def _text(content, param: str):
    """A content field: text, or a list of text parts joined (what else it holds, the request checks)."""
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise BadRequest(f"{param} may hold only text parts", param)
        return "".join(p["text"] for p in content)
    return content


def _verification(body: dict, default: Verification) -> Verification:
    """The body's verification with its head: the server's where it names neither; a head alone asks for
    "diversed" (with the server's shift where its rule is "diversed"); "diversed" without a head takes the
    server's head, if it names one."""
    text, head = body.get("verification"), body.get("head")
    if text is None:
        verification = default if head is None or default.name == "diversed" else Verification("diversed")
        if head is not None and default.name == "diversed":
            verification = Verification("diversed", shift=default.shift)
    else:
        verification = Verification.parse(text)
        if verification.name == "diversed" and verification.head is None and head is None and \
                default.name == "diversed":
            verification = Verification("diversed", head=default.head, shift=verification.shift)
    return verification.with_head(head)


def _flag(body: dict, name: str, param: str | None = None) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"{param or name} must be true or false", param or name)
    return value


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


def usage(prompt_tokens: int, completion_tokens: int, prediction: tuple[int, int] | None = None,
          cached_tokens: int = 0) -> dict:
    """OpenAI's usage object, with the prompt tokens the prompt cache held (prompt_tokens_details); with a
    prediction's (accepted, rejected) tokens, its completion_tokens_details."""
    counts = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
              "total_tokens": prompt_tokens + completion_tokens,
              "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if prediction is not None:
        counts["completion_tokens_details"] = {"accepted_prediction_tokens": prediction[0],
                                               "rejected_prediction_tokens": prediction[1]}
    return counts
