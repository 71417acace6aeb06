"""A server on the tiny models for the tests that speak HTTP to it (the openai client, a browser)."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import openai
import uvicorn

from diversed.head.model import EnsembleHead, HeadConfig
from diversed.models.loading import Pair
from diversed.request import Drafting
from diversed.server import ServerConfig, create_app

from tiny import WORDS, perturbed, tiny_model, word_tokenizer

CHAT_TEMPLATE = ("{% for m in messages %}{% if loop.first and m['role'] == 'assistant' %}"
                 "{{ raise_exception('a conversation starts with a user or system turn') }}{% endif %}"
                 "t{{ 2 + (m['role'] == 'user') }} {{ m['content'] }} {% endfor %}t4")
DRAFTING = Drafting(3)


def tiny_chat_pair() -> Pair:
    """The tiny pair with a chat template."""
    target = tiny_model(0, vocab=WORDS, hidden=32)
    tokenizer = word_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return Pair(perturbed(target, 0.05, 1), target, tokenizer, "tiny-draft", "tiny-target")


def save_flat_head(folder) -> str:
    """A head for the tiny pair that gives w = 0.3 everywhere (an untrained head starts at its initial w)."""
    EnsembleHead(HeadConfig(32, 32, initial_weight=0.3, draft_model="tiny-draft", target_model="tiny-target")
                 ).save(folder)
    return str(folder)


class _Slow:
    """A backend model whose every forward takes at least `delay` seconds: requests overlap for sure."""

    def __init__(self, model, delay: float) -> None:
        self._model, self._delay = model, delay

    def __getattr__(self, name):
        return getattr(self._model, name)

    def rows(self, count, capacity=None):
        rows, delay = self._model.rows(count, capacity), self._delay

        class SlowRows:
            def __getattr__(self, name):
                return getattr(rows, name)

            def feed(self, *args, **kwargs):
                time.sleep(delay)
                return rows.feed(*args, **kwargs)

        return SlowRows()


@contextmanager
def serving(pair: Pair, delay: float = 0.0, **options):
    """A server on a free loopback port in this process; yields (base url, app)."""
    if delay:
        pair = Pair(_Slow(pair.draft, delay), _Slow(pair.target, delay), pair.tokenizer, pair.draft_name,
                    pair.target_name)
    app = create_app(pair, ServerConfig(**{"drafting": DRAFTING, **options}))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(30)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
