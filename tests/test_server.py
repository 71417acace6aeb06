"""`diversed serve` through the official openai client, on the tiny models: completions, chat, streaming,
the verification dial, errors, metrics, the queue, disconnects, failures, a load test, and draining on
SIGTERM."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request

import openai
import pytest
import torch
from closed_forms import verification_target
from prometheus_client.parser import text_string_to_metric_families
from serving import DRAFTING, client, save_flat_head, serving, tiny_chat_pair

from diversed.decoding.drafters import prediction_tokens
from diversed.generation import generate
from diversed.models.loading import Pair

from tiny import WORDS, save_tiny_pair, tiny_model, toy_pair, word_tokenizer

RULES = ["exact", "static:0.7", "lossy:0.3", "plain", "diversed"]


@pytest.fixture(scope="module")
def pair() -> Pair:
    return tiny_chat_pair()


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory) -> str:
    return save_flat_head(tmp_path_factory.mktemp("head"))


@pytest.fixture(scope="module")
def server(pair, head_dir):
    with serving(pair, heads={"flat": head_dir}) as (url, app):
        yield url, app


def solo(pair: Pair, prompt: str, rule: str, max_tokens: int, head_dir: str, chat: bool = False) -> str:
    """What `generate` writes for the prompt alone at T = 0 with the server's drafting."""
    verification = f"diversed:{head_dir}" if rule == "diversed" else rule
    return generate(pair, prompt, verification=verification, temperature=0, max_new_tokens=max_tokens, chat=chat,
                    drafting=DRAFTING)[0].text


def test_completion_equals_generate_and_reports_usage_and_speculative_metrics(server, pair, head_dir):
    url, _ = server
    out = client(url).completions.create(model="tiny-target", prompt="t5 t6 t7", max_tokens=12, temperature=0)
    assert out.choices[0].text == solo(pair, "t5 t6 t7", "exact", 12, head_dir)
    assert out.choices[0].finish_reason in ("length", "stop")
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens <= 12
    speculative = out.model_extra["speculative"]
    assert speculative["verification"] == "exact" and speculative["drafted"] >= speculative["accepted"] >= 0


def test_chat_uses_the_chat_template(server, pair, head_dir):
    url, _ = server
    out = client(url).chat.completions.create(model="tiny-target", messages=[{"role": "user", "content": "t8 t9"}],
                                              max_tokens=10, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == solo(pair, "t8 t9", "exact", 10, head_dir, chat=True)


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_chunks_join_into_the_whole_response_with_usage_last(server, chat):
    url, _ = server
    api = client(url)
    args = dict(model="tiny-target", max_tokens=15, temperature=0, extra_body={"verification": "static:0.6"})
    if chat:
        messages = [{"role": "user", "content": "t11 t12"}]
        whole = api.chat.completions.create(messages=messages, **args).choices[0].message.content
        chunks = list(api.chat.completions.create(messages=messages, stream=True,
                                                  stream_options={"include_usage": True}, **args))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[0].choices[0].delta.role == "assistant"
    else:
        whole = api.completions.create(prompt="t11 t12", **args).choices[0].text
        chunks = list(api.completions.create(prompt="t11 t12", stream=True, stream_options={"include_usage": True},
                                             **args))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    finishing = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None and "usage" in c.model_fields_set for c in chunks[:-1])  # null, as OpenAI's
    assert chunks[-1].model_extra["speculative"]["verification"] == "static:0.6"


def test_the_stream_ends_with_done(server):
    url, _ = server
    lines = _raw(url, "POST", "/v1/completions", {"prompt": "t3 t4", "max_tokens": 5, "stream": True})[1]
    events = [line for line in lines.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-1])


@pytest.mark.parametrize("rule", RULES)
def test_the_dial_picks_the_rule_per_request(server, pair, head_dir, rule):
    url, _ = server
    extra = {"verification": rule} | ({"head": "flat"} if rule == "diversed" else {})
    out = client(url).completions.create(model="tiny-target", prompt="t13 t14 t15", max_tokens=20, temperature=0,
                                         extra_body=extra)
    assert out.choices[0].text == solo(pair, "t13 t14 t15", rule, 20, head_dir)
    label = out.model_extra["speculative"]["verification"]
    assert label == ("diversed:flat" if rule == "diversed" else rule)


def test_a_heads_shift_travels_in_the_verification_string(server, pair, head_dir):
    url, _ = server
    out = client(url).completions.create(model="tiny-target", prompt="t13 t14 t15", max_tokens=20, temperature=0,
                                         extra_body={"verification": "diversed:flat@+1"})
    alone = generate(pair, "t13 t14 t15", verification=f"diversed:{head_dir}@+1", temperature=0, max_new_tokens=20,
                     chat=False, drafting=DRAFTING)[0].text
    assert out.choices[0].text == alone
    assert out.model_extra["speculative"]["verification"] == "diversed:flat@+1"


def test_requests_without_a_rule_of_their_own_follow_the_servers_diversed_verification(pair, head_dir):
    """With --verification diversed:flat@+1: a request naming only a head keeps the shift, and one asking for plain
    "diversed" gets the --verification's head, not the first one loaded."""
    with serving(pair, heads={"other": head_dir, "flat": head_dir}, verification="diversed:flat@+1") as (url, _):
        labels = [client(url).completions.create(model="tiny-target", prompt="t3", max_tokens=4, temperature=0,
                                                 extra_body=extra).model_extra["speculative"]["verification"]
                  for extra in ({}, {"head": "other"}, {"verification": "diversed"})]
    assert labels == ["diversed:flat@+1", "diversed:other@+1", "diversed:flat"]


def test_a_sampled_request_with_a_seed_is_reproducible(server):
    url, _ = server

    def text(seed: int) -> str:
        return client(url).completions.create(model="tiny-target", prompt="t5 t6", max_tokens=24, temperature=1.0,
                                              seed=seed, extra_body={"verification": "static:0.5"}).choices[0].text

    assert text(7) == text(7)
    assert len({text(seed) for seed in (7, 8, 9, 10)}) > 1  # the seed is what fixes it


def test_relaxed_rules_keep_more_drafts_than_exact():
    """On a pair that disagrees (the toy pair leans to different tokens), in one server."""
    with serving(toy_pair()) as (url, _):
        api = client(url)
        rates = {}
        for rule in ("exact", "static:0.2"):
            out = api.completions.create(model="tiny-target", prompt="t5 t9 t2", max_tokens=60, temperature=1.0,
                                         seed=3, extra_body={"verification": rule})
            rates[rule] = out.model_extra["speculative"]["acceptance_rate"]
    assert rates["static:0.2"] > rates["exact"] + 0.2


@pytest.mark.parametrize("field", ["max_drafts", "draft_length"])  # draft_length: its name until this release
def test_max_drafts_caps_a_requests_drafts(server, field):
    url, _ = server
    out = client(url).completions.create(model="tiny-target", prompt="t5 t6", max_tokens=20, temperature=0,
                                         extra_body={field: 1})
    assert len(out.model_extra["speculative"]["per_position_acceptance"]) == 1


@pytest.mark.parametrize("drafter", ["lookup", "suffix", "model"])
def test_a_request_picks_its_drafter_and_the_reply_says_who_drafted_and_who_decided(server, pair, head_dir, drafter):
    url, _ = server
    prompt = "t5 t6 t7 t5 t6 t7 t5 t6"
    out = client(url).completions.create(model="tiny-target", prompt=prompt, max_tokens=20, temperature=0,
                                         extra_body={"drafter": drafter})
    assert out.choices[0].text == solo(pair, prompt, "exact", 20, head_dir)  # greedy exact: the target's text
    speculative = out.model_extra["speculative"]
    assert set(speculative["drafters"]) <= {drafter}
    assert speculative["rule_tokens"] + speculative["target_tokens"] == out.usage.completion_tokens


def test_predicted_outputs_through_the_openai_client(server, pair, head_dir):
    """The official client's `prediction=`: the answer is the target's (greedy exact), drafted from the prediction,
    and usage counts its accepted and rejected tokens as OpenAI does."""
    url, _ = server
    messages = [{"role": "user", "content": "t8 t9"}]
    alone = generate(pair, [messages], temperature=0, max_new_tokens=24, drafting=DRAFTING)[0]
    words = alone.text.split()
    changed = " ".join(words[:8] + ["t3", "t3"] + words[10:])  # the prediction, two words off
    out = client(url).chat.completions.create(model="tiny-target", messages=messages, max_tokens=24, temperature=0,
                                              prediction={"type": "content", "content": changed})
    assert out.choices[0].message.content == alone.text
    details = out.usage.completion_tokens_details
    predicted = pair.tokenizer(changed, add_special_tokens=False)["input_ids"]
    counts = (details.accepted_prediction_tokens, details.rejected_prediction_tokens)
    assert counts == prediction_tokens(predicted, alone.tokens) and counts[1] >= 2
    assert out.model_extra["speculative"]["drafters"]["prediction"]["accepted"] > 0
    plain = client(url).completions.create(model="tiny-target", prompt="t8 t9", max_tokens=6, temperature=0,
                                           extra_body={"prediction": {"type": "content", "content": "t3 t4"}})
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens is not None


@pytest.mark.parametrize("rule", ["exact", "lossy:0.9", "plain"])
def test_provenance_through_the_openai_client(server, rule):
    """`provenance: true` (extra body) adds each token's origin to the choice; it agrees with the text and the
    speculative counts, exact never relaxes a token, and without it the reply has no new field."""
    url, _ = server
    api = client(url)
    ask = {"model": "tiny-target", "prompt": "t5 t6 t7", "max_tokens": 24, "temperature": 1.0, "seed": 3}
    plain = api.completions.create(**ask, extra_body={"verification": rule})
    assert "provenance" not in plain.choices[0].model_extra
    out = api.completions.create(**ask, extra_body={"verification": rule, "provenance": True})
    choice, speculative = out.choices[0], out.model_extra["speculative"]
    records = choice.model_extra["provenance"]
    assert choice.text == plain.choices[0].text == "".join(r["token"] for r in records)
    assert len(records) == out.usage.completion_tokens
    origins = [r["origin"] for r in records]
    rounds = {r["round"]: r["drafted"] for r in records}
    assert sorted(rounds) == list(range(1, len(rounds) + 1))
    assert len(records) / len(rounds) == pytest.approx(speculative["tau"])
    if rule == "plain":
        assert set(origins) == {"target"} and all(r["p"] > 0 and r["q"] is None for r in records)
        return
    assert choice.finish_reason == "length"  # nothing cut at EOS: every kept draft is in the text
    assert origins.count("kept") + origins.count("relaxed") == speculative["accepted"]
    assert sum(rounds.values()) == speculative["drafted"]
    for r in records:
        assert 0 < r["p"] <= 1 and r["drafter"] == "model"
        if r["origin"] in ("kept", "relaxed", "correction"):
            assert 0 <= r["exact_acceptance"] <= r["acceptance"] <= 1 and 0 < r["q"] <= 1
        if r["origin"] == "correction":
            assert r["rejected"] and r["rejected_token_id"] is not None
    if rule == "exact":
        assert "relaxed" not in origins


def test_streamed_provenance_joins_into_the_whole_one(server):
    url, _ = server
    ask = {"model": "tiny-target", "messages": [{"role": "user", "content": "t4 t9"}], "max_tokens": 16,
           "temperature": 0}
    whole = client(url).chat.completions.create(**ask, extra_body={"provenance": True})
    chunks = list(client(url).chat.completions.create(**ask, stream=True, extra_body={"provenance": True}))
    streamed = [r for c in chunks if c.choices for r in (c.choices[0].model_extra.get("provenance") or [])]
    assert streamed == whole.choices[0].model_extra["provenance"]
    assert "".join(r["token"] for r in streamed) == whole.choices[0].message.content


def test_the_dial_endpoint_lists_what_a_request_may_set(server):
    url, _ = server
    with urllib.request.urlopen(url + "/v1/verification") as response:
        dial = json.loads(response.read())
    rules = {r["name"]: r for r in dial["rules"]}
    assert dial["default"] == "exact" and rules["diversed"]["heads"] == ["flat"] and "dynamic" not in rules
    assert [(p["name"], p["min"], p["max"], p["max_open"]) for p in rules["lossy"]["parameters"]] == \
        [("lenience", 0.0, 1.0, True)]
    judi = {p["name"]: p for p in rules["judi"]["parameters"]}
    assert judi["max_confidence"]["default"] == 0.9 and judi["epsilon"]["max"] is None
    assert {d["name"] for d in dial["drafters"] if d["available"]} == {"auto", "model", "lookup", "suffix",
                                                                       "prediction"}
    with urllib.request.urlopen(url + "/") as page:
        assert page.status == 200 and b"/static/playground.js" in page.read()


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "t3", "prediction": {"type": "text", "content": "t3"}}, "prediction"),
    ({"prompt": "t3", "prediction": "t3 t4"}, "prediction"),
    ({"prompt": "t3", "prediction": {"type": "content", "content": 5}}, "prediction"),
    ({"prompt": "t3", "prediction": {"type": "content", "content": ""}}, "prediction"),
    ({"prompt": "t3", "prediction": {"type": "content", "content": " ".join(["t3"] * 300)}}, "prediction"),
    ({"prompt": "t3", "prediction": {"type": "content", "content": "t3"}, "drafter": "lookup"}, "prediction"),
    ({"prompt": "t3", "prediction": {"type": "content", "content": "t3"}, "verification": "plain"}, "prediction"),
    ({"prompt": "t3", "drafter": "prediction"}, "drafter"),
    ({"prompt": "t3", "provenance": "yes"}, "provenance"),
    ({"prompt": "t3", "verification": "strict"}, "verification"),
    ({"prompt": "t3", "verification": "static:1.5"}, "verification"),
    ({"prompt": "t3", "verification": "diversed", "head": "missing"}, "head"),
    ({"prompt": "t3", "verification": "diversed:missing"}, "verification"),
    ({"prompt": "t3", "verification": "diversed:flat@inf"}, "verification"),
    ({"prompt": "t3", "verification": "diversed:flat@+1", "head": "other"}, "head"),
    ({"prompt": "t3", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "t3", "max_tokens": 10_000}, "max_tokens"),
    ({"prompt": " ".join(["t3"] * 300)}, "prompt"),
    ({"prompt": "t3", "n": 2}, "n"),
    ({"prompt": "t3", "temperature": -1}, "temperature"),
    ({"prompt": "t3", "stop": 5}, "stop"),
    ({"prompt": "t3", "colour": "blue"}, "colour"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "t3", "max_drafts": 0}, "max_drafts"),
    ({"prompt": "t3", "draft_length": 2, "max_drafts": 2}, "draft_length"),
    ({"prompt": "t3", "drafter": "ngram"}, "drafter"),
    ({"prompt": "t3", "verification": "diversed", "head": "flat", "drafter": "lookup"}, "drafter"),
    ({"prompt": "t3", "temperature": 10**400}, "temperature"),
    ({"prompt": "t3", "top_p": -10**400}, "top_p"),
    ({"prompt": "t3", "verification": "typical:1e39"}, "verification"),
    ({"prompt": "t3", "top_logprobs": 0}, "top_logprobs"),
    ({"prompt": "t3", "user": 5}, "user"),
    ({"prompt": "t3", "metadata": "x"}, "metadata"),
])
def test_bad_requests_get_400_naming_the_field(server, body, param):
    url, _ = server
    with pytest.raises(openai.BadRequestError) as error:
        # Everything but the prompt goes as extra body fields: the client would refuse some of them itself.
        client(url).completions.create(model="tiny-target", prompt=body["prompt"],
                                       extra_body={"max_tokens": 4} | {k: v for k, v in body.items() if k != "prompt"})
    assert error.value.status_code == 400
    assert error.value.body["param"] == param and error.value.body["type"] == "invalid_request_error"
    assert error.value.body["message"]


def test_a_bad_rule_is_refused_in_the_words_of_the_field_verification(server):
    url, _ = server
    with pytest.raises(openai.BadRequestError) as error:
        client(url).completions.create(model="tiny-target", prompt="t3", max_tokens=4,
                                       extra_body={"verification": "strict"})
    assert error.value.body["message"].startswith("verification must be one of ("), error.value.body


def test_bad_chat_and_invalid_json_get_400(server):
    url, _ = server
    with pytest.raises(openai.BadRequestError) as error:
        client(url).chat.completions.create(model="tiny-target", messages=[{"role": "robot", "content": "t3"}])
    assert error.value.body["param"] == "messages"
    status, body = _raw(url, "POST", "/v1/completions", b"{not json")
    assert status == 400 and json.loads(body)["error"]["code"] == "invalid_json"
    status, body = _raw(url, "POST", "/v1/chat/completions", [1, 2])
    assert status == 400 and set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
    for deep in (b"[" * 100_000 + b"]" * 100_000, b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"):
        status, body = _raw(url, "POST", "/v1/completions", deep)
        assert status == 400 and json.loads(body)["error"]["code"] == "invalid_json"


@pytest.mark.parametrize(("body", "param"), [
    ({"max_completion_tokens": 2, "max_tokens": "x"}, "max_tokens"),
    ({"max_completion_tokens": 2, "max_tokens": 3}, "max_completion_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"echo": True}, "echo"),
    ({"best_of": 1}, "best_of"),
    ({"messages": [{"role": "user", "content": "t3", "name": "bob"}]}, "messages[0].name"),
])
def test_bad_chat_requests_get_400_naming_the_field(server, body, param):
    url, _ = server
    status, reply = _raw(url, "POST", "/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "t3"}]} | body)
    assert status == 400 and json.loads(reply)["error"]["param"] == param, reply


def test_a_message_passed_back_from_a_response_is_taken_with_its_empty_fields(server):
    url, _ = server
    said = client(url).chat.completions.create(model="tiny-target", messages=[{"role": "user", "content": "t3"}],
                                               max_tokens=2).choices[0].message
    again = client(url).chat.completions.create(
        model="tiny-target", max_completion_tokens=2, max_tokens=2,
        messages=[{"role": "user", "content": "t3"}, said.model_dump(), {"role": "user", "content": "t4"}])
    assert again.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(("method", "path", "status"), [("GET", "/v1/completions", 405), ("POST", "/v1/nope", 404),
                                                         ("GET", "/v1/models/tiny-target", 404)])
def test_unknown_paths_and_methods_get_openais_error_body(server, method, path, status):
    url, _ = server
    code, reply = _raw(url, method, path, None if method == "GET" else {})
    error = json.loads(reply)["error"]
    assert code == status and error["type"] == "invalid_request_error" and path in error["message"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "t3 \ud800"}, "prompt"),
    ("/v1/completions", {"prompt": "t3", "stop": ["\udcff"]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t3 \ud800"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "t3"}]}, "messages"),
])
def test_text_the_tokenizer_cannot_take_gets_400_not_500(server, path, body, param):
    """A lone surrogate is valid JSON but not text; a chat template may refuse a conversation itself."""
    url, _ = server
    status, reply = _raw(url, "POST", path, {"model": "tiny-target", "max_tokens": 2} | body)
    assert status == 400 and json.loads(reply)["error"]["param"] == param


def test_unknown_model_is_404(server):
    url, _ = server
    with pytest.raises(openai.NotFoundError):
        client(url).completions.create(model="gpt-4", prompt="t3", max_tokens=2)


def test_models_health_and_metrics(server):
    url, _ = server
    assert [m.id for m in client(url).models.list()] == ["tiny-target"]
    status, body = _raw(url, "GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"

    def scrape() -> dict:
        return {f.name: f for f in text_string_to_metric_families(_raw(url, "GET", "/metrics")[1])}

    def total(families: dict, name: str, **labels) -> float:
        return sum(s.value for s in families[name].samples
                   if s.name.endswith("_total") and labels.items() <= s.labels.items())

    before = scrape()
    replies = [client(url).completions.create(model="tiny-target", prompt="t6 t6", max_tokens=8, temperature=0,
                                              extra_body={"verification": f"static:{weight}"})
               for weight in (0.5, 0.25)]
    families = scrape()
    for name in ("diversed:num_requests_running", "diversed:num_requests_waiting", "diversed:generation_tokens",
                 "diversed:time_to_first_token_seconds", "diversed:inter_token_latency_seconds",
                 "diversed:spec_decode_num_drafts", "diversed:spec_decode_num_draft_tokens",
                 "diversed:spec_decode_num_accepted_tokens", "diversed:spec_decode_num_accepted_tokens_per_pos"):
        assert name in families, name
    drafted = {s.labels["verification"]: s.value for s in families["diversed:spec_decode_num_draft_tokens"].samples
               if s.name.endswith("_total")}
    assert drafted["static"] > 0 and not any(label.startswith("static:") for label in drafted)  # none per weight
    # What these two requests added is exactly what their replies report.
    for name, labels, reported in (
            ("diversed:generation_tokens", {}, sum(r.usage.completion_tokens for r in replies)),
            ("diversed:spec_decode_num_draft_tokens", {"verification": "static"},
             sum(r.model_extra["speculative"]["drafted"] for r in replies)),
            ("diversed:spec_decode_num_accepted_tokens", {"verification": "static"},
             sum(r.model_extra["speculative"]["accepted"] for r in replies))):
        assert total(families, name, **labels) - total(before, name, **labels) == reported > 0, name


def test_a_full_queue_gets_503_and_a_disconnect_frees_the_row(pair):
    with serving(pair, delay=0.02, max_batch=1, max_waiting=0) as (url, _):
        api = client(url)
        stream = api.completions.create(model="tiny-target", prompt="t3 t4", max_tokens=200, temperature=0,
                                        stream=True)
        next(iter(stream))  # the first request holds the batch's only row
        with pytest.raises(openai.InternalServerError) as error:
            api.completions.create(model="tiny-target", prompt="t5", max_tokens=2)
        assert error.value.status_code == 503 and error.value.body["code"] == "server_overloaded"
        stream.close()  # the client goes away mid-stream
        _wait_idle(url)
        assert api.completions.create(model="tiny-target", prompt="t5", max_tokens=2, temperature=0).choices[0].text


def test_a_client_that_leaves_a_whole_response_frees_its_row(pair):
    import socket

    with serving(pair, delay=0.05, max_batch=1) as (url, _):  # 200 tokens then take over 10 s
        port = int(url.rsplit(":", 1)[1])
        body = json.dumps({"prompt": "t3 t4", "max_tokens": 200, "temperature": 0}).encode()
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            deadline = time.monotonic() + 10
            while json.loads(_raw(url, "GET", "/health")[1])["running"] == 0:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        # The socket is closed long before 200 slow rounds are done: the row must be freed early.
        started = time.monotonic()
        _wait_idle(url)
        assert time.monotonic() - started < 3


def test_one_requests_failure_leaves_the_others_of_its_batch_whole(pair, head_dir):
    def broken(h_draft, h_target):
        raise RuntimeError("this head is broken")

    with serving(pair, delay=0.005, heads={"flat": head_dir}) as (url, app):
        app.state.server.heads["broken"] = broken
        api = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)

        async def one(rule: str, prompt: str):
            extra = {"verification": "diversed", "head": rule} if rule == "broken" else {"verification": rule}
            try:
                out = await api.completions.create(model="tiny-target", prompt=prompt, max_tokens=30,
                                                   temperature=0, extra_body=extra)
                return out.choices[0].text
            except openai.APIStatusError as error:
                return error

        async def together():
            return await asyncio.gather(one("exact", "t3 t9"), one("broken", "t4 t9"), one("static:0.5", "t5 t9"))

        exact, failed, static = asyncio.run(together())
    assert isinstance(failed, openai.InternalServerError) and "this head is broken" in failed.body["message"]
    assert exact == solo(pair, "t3 t9", "exact", 30, head_dir)
    assert static == solo(pair, "t5 t9", "static:0.5", 30, head_dir)


@pytest.mark.parametrize("clients", [16, 32])
def test_load_mixed_rules_streams_equal_their_solo_runs(pair, head_dir, clients):
    """Concurrent streaming clients, mixed rules, every fifth disconnecting early: every finished stream at
    T = 0 equals its prompt's run alone (or first differs at a near-tie), nothing lost, duplicated or mixed
    up, and the server is idle and healthy afterwards."""
    rng = random.Random(clients)
    requests = [(" ".join(f"t{rng.randrange(2, WORDS)}" for _ in range(rng.randrange(2, 8))), rng.choice(RULES),
                 rng.randrange(8, 40), i % 5 == 4) for i in range(clients)]
    with serving(pair, heads={"flat": head_dir}, max_batch=8) as (url, _):
        api = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

        async def one(prompt: str, rule: str, max_tokens: int, leave: bool):
            extra = {"verification": rule} | ({"head": "flat"} if rule == "diversed" else {})
            stream = await api.completions.create(model="tiny-target", prompt=prompt, max_tokens=max_tokens,
                                                  temperature=0, stream=True, extra_body=extra)
            text, reasons = "", []
            async for chunk in stream:
                text += chunk.choices[0].text
                reasons += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
                if leave:
                    await stream.close()
                    return None
            return text, reasons

        async def everyone():
            return await asyncio.gather(*(one(*r) for r in requests))

        results = asyncio.run(everyone())
        _wait_idle(url)
        # Healthy afterwards: a new request is served (greedy: a sampled first token may be EOS, an empty text).
        after = client(url).completions.create(model="tiny-target", prompt="t3", max_tokens=3, temperature=0)
        assert after.choices[0].text
    for (prompt, rule, max_tokens, leave), result in zip(requests, results, strict=True):
        if leave:
            continue
        text, reasons = result
        assert len(reasons) == 1
        expected = solo(pair, prompt, rule, max_tokens, head_dir)
        if text != expected:
            _assert_first_difference_is_a_near_tie(pair, prompt, rule, text, expected)


def _assert_first_difference_is_a_near_tie(pair: Pair, prompt: str, rule: str, served: str, alone: str) -> None:
    """Batching may change the last bits of the logits: the first differing token must then be one of two
    tokens that the rule's distribution (or the target's, for a bonus token) scores within 1e-4."""
    a, b = ([int(w[1:]) for w in text.split()] for text in (served, alone))
    i = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    ids = torch.tensor([pair.tokenizer(prompt)["input_ids"] + b[:i]])
    with torch.no_grad():
        p, q = (torch.softmax(model.model(ids).logits[0, -1], -1) for model in (pair.target, pair.draft))
    weight = {"static:0.7": 0.7, "diversed": 0.3}.get(rule)
    candidates = [p] + ([verification_target("static", p, q, weight=weight)] if weight is not None else [])
    assert any(abs(float(d[a[i]] - d[b[i]])) < 1e-4 for d in candidates), \
        f"{rule} on {prompt!r}: served and solo first differ at token {i} ({a[i]} vs {b[i]}), not a near-tie"


def test_sigterm_drains_running_requests_then_exits(tmp_path):
    paths = save_tiny_pair(tiny_model(0, vocab=WORDS, hidden=32, arch="olmo2"), tmp_path)
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "diversed.cli", "serve", "--backend", "transformers", "--draft", paths["draft"],
         "--target", paths["target"], "--port", str(port), "--draft-length", "3", "--dtype", "float32"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None and time.monotonic() < deadline, process.stdout.read().decode()[-2000:]
            try:
                if _raw(url, "GET", "/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.2)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        connection.request("POST", "/v1/completions", json.dumps(
            {"prompt": "t3 t4", "max_tokens": 200, "temperature": 0, "stream": True}),
            {"Content-Type": "application/json"})
        response = connection.getresponse()
        first = response.readline()
        assert first.startswith(b"data: {")
        process.send_signal(signal.SIGTERM)
        rest = response.read().decode()
        assert rest.rstrip().endswith("data: [DONE]")
        finishing = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in rest.split("\n\n")
                     if e.startswith("data: {")]
        assert finishing[-1] in ("length", "stop")  # the request ran to its end, not cut off
        # uvicorn shuts down gracefully, then re-raises the signal it caught: killed by SIGTERM, after draining.
        assert process.wait(60) in (0, -signal.SIGTERM)
        assert "Finished server process" in process.stdout.read().decode()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _wait_idle(url: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        health = json.loads(_raw(url, "GET", "/health")[1])
        if health["running"] == 0 and health["waiting"] == 0:
            return
        assert time.monotonic() < deadline, f"the server stays busy: {health}"
        time.sleep(0.05)


def _raw(url: str, method: str, path: str, body=None) -> tuple[int, str]:
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    data = body if isinstance(body, bytes) else None if body is None else json.dumps(body)
    connection.request(method, path, data, {"Content-Type": "application/json"})
    response = connection.getresponse()
    return response.status, response.read().decode()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



@pytest.mark.parametrize("stop", [(), ("t8",), ("t7 t8",), ("t9 t9 t9",)])
def test_streamed_text_never_takes_back_and_joins_into_the_cut_text(stop):
    from diversed.text import StreamedText, cut_at_stop

    tokenizer = word_tokenizer()
    tokens = tokenizer("t3 t7 t8 t9 t7 t8 t5")["input_ids"]
    streamed, pieces = StreamedText(tokenizer, stop), []
    for end in range(1, len(tokens) + 1):
        pieces.append(streamed.add(tokens[end - 1:end], final=end == len(tokens)))
        assert not any(s in "".join(pieces) for s in stop)
    assert "".join(pieces) == cut_at_stop(tokenizer.decode(tokens, skip_special_tokens=True), stop)


def test_an_unfinished_character_is_held_back():
    from diversed.text import StreamedText

    class Bytes:  # a byte-level tokenizer: a multi-byte character may span tokens
        def decode(self, tokens, skip_special_tokens=True):
            return bytes(tokens).decode("utf-8", errors="replace")

    euro = list("a€b".encode())
    streamed = StreamedText(Bytes(), ())
    pieces = [streamed.add([token]) for token in euro]
    assert pieces == ["a", "", "", "€", "b"]


@pytest.mark.parametrize("stop", [(), ("€b",), ("b\n",), ("zz", "€")])
def test_streamed_text_in_chunks_of_any_size_joins_into_the_cut_text(stop):
    import random

    from diversed.text import StreamedText, cut_at_stop

    class Bytes:
        def decode(self, tokens, skip_special_tokens=True):
            return bytes(tokens).decode("utf-8", errors="replace")

    tokens = list("a€b\nxé€b\nzz€".encode()) * 3
    rng = random.Random(0)
    for _ in range(20):
        streamed, pieces, start = StreamedText(Bytes(), stop), [], 0
        while start < len(tokens):
            end = min(len(tokens), start + rng.randint(1, 5))
            pieces.append(streamed.add(tokens[start:end], final=end == len(tokens)))
            start = end
        assert "".join(pieces) == cut_at_stop(Bytes().decode(tokens), stop)


def test_the_stop_checker_finds_the_token_that_completes_a_stop_string_across_rounds():
    from diversed.text import stop_checker

    tokenizer = word_tokenizer()
    tokens = tokenizer("t3 t7 t8 t9 t7 t8 t5")["input_ids"]
    find = stop_checker(tokenizer, ["t9 t7"])
    assert find(tokens[:4], 0) is None and find(tokens[:5], 4) == 5  # the stop string spans the rounds
    assert find(tokens, 2) == 5  # a round that wrote past it is cut where it was completed
    assert stop_checker(tokenizer, []) is None
