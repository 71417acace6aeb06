"""The llama.cpp backend's prompt cache: a row that starts from a cached prefix reads only the rest of its
prompt and gets what a cold read gives, up to llama.cpp's own batch-shape noise; the cache stays within its
bound, least recently used out; a row dropped mid-prompt leaves a cache that is still right; concurrent
conversations each keep their own prefix; the decoding loop counts what it reused."""

import urllib.request

import pytest
import torch

from diversed.backends.llama_cpp import LlamaCppModel
from diversed.decoding.engine import decode
from diversed.request import Drafting, Sampling, Verification

from tiny import tiny_gguf, tiny_model

ATOL = 2e-3  # llama.cpp's float32 sums differ in their last bits with a pass's shape


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny_gguf(tiny_model(0), tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def conversation(seed: int, length: int) -> list[int]:
    return torch.randint(3, 90, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def cold_logits(path, tokens: list[int], outputs: int = 2) -> torch.Tensor:
    return LlamaCppModel(path, cache_mib=0, context=256).rows(1).feed([tokens], outputs)[1][0]


def finish(model: LlamaCppModel, prompts: list[list[int]]) -> None:
    """Rows that read these prompts and then leave (their cells go to the cache)."""
    rows = model.rows(len(prompts))
    rows.feed(prompts, 1)
    rows.select([])


def test_a_cached_prefix_gives_a_cold_reads_logits(path):
    model = LlamaCppModel(path, context=256)
    first = conversation(0, 40)
    finish(model, [first])
    follow_up = first + conversation(1, 12)
    rows = model.rows(1)
    assert rows.reuse(0, follow_up) == len(first) and rows.lengths == [len(first)]
    _, logits = rows.feed([follow_up[len(first):]], 2)
    torch.testing.assert_close(logits[0], cold_logits(path, follow_up), atol=ATOL, rtol=0)
    # A prompt that ends where the entry ends still reads its last token (its logits are the first output).
    rows = model.rows(1)
    assert rows.reuse(0, first) == len(first) - 1


def test_the_cache_keeps_within_its_bound_least_recently_used_out(path):
    model = LlamaCppModel(path, context=64)
    rows = model.rows(2)  # a context of 4 rows: 8 cache slots of at most 64 tokens each
    rows.select([])
    cache = model.cache
    assert len(cache.free) == 8 and cache.budget == 8 * 64
    prompts = [conversation(seed, 60) for seed in range(12)]
    for prompt in prompts:
        finish(model, [prompt])
        assert cache.held <= cache.budget and len(cache.entries) <= 8
    assert [cache.longest(p)[1] for p in prompts[:4]] == [0] * 4  # the oldest went first
    assert all(cache.longest(p)[1] == 60 for p in prompts[4:])
    # After every eviction, a reused prefix still reads right.
    rows = model.rows(1)
    assert rows.reuse(0, prompts[-1] + [5, 6]) == 60
    torch.testing.assert_close(rows.feed([[5, 6]], 1)[1][0], cold_logits(path, prompts[-1] + [5, 6], 1),
                               atol=ATOL, rtol=0)


def test_a_longer_turn_replaces_the_entry_it_extends(path):
    model = LlamaCppModel(path, context=256)
    turn = conversation(2, 30)
    finish(model, [turn])
    finish(model, [turn + conversation(3, 20)])
    assert list(model.cache.entries.values()) == [turn + conversation(3, 20)]
    finish(model, [turn[:10]])  # held already
    assert len(model.cache.entries) == 1


def test_a_row_dropped_mid_prompt_leaves_a_right_cache(path):
    model = LlamaCppModel(path, context=256)
    prompt = conversation(4, 50)
    rows = model.rows(1)
    rows.feed([prompt[:20]], 1)  # cancelled after reading part of its prompt
    rows.select([])
    rows = model.rows(1)
    assert rows.reuse(0, prompt) == 20
    torch.testing.assert_close(rows.feed([prompt[20:]], 1)[1][0], cold_logits(path, prompt, 1), atol=ATOL, rtol=0)


def test_four_conversations_each_keep_their_prefix(path):
    model = LlamaCppModel(path, context=256)
    histories = [conversation(10 + i, 30 + 5 * i) for i in range(4)]
    finish(model, histories)
    turns = [history + conversation(20 + i, 6) for i, history in enumerate(histories)]
    rows = model.rows(4)
    assert [rows.reuse(i, turn) for i, turn in enumerate(turns)] == [len(h) for h in histories]
    _, logits = rows.feed([turn[len(h):] for turn, h in zip(turns, histories, strict=True)], 1)
    for i, turn in enumerate(turns):
        torch.testing.assert_close(logits[i], cold_logits(path, turn, 1), atol=ATOL, rtol=0)


def test_the_loop_reads_only_what_the_cache_lacks_unless_told_not_to(path, tmp_path):
    target = LlamaCppModel(path, context=256)
    draft = LlamaCppModel(tiny_gguf(tiny_model(0), tmp_path / "draft.gguf"), context=256)
    prompt = conversation(30, 40)
    options = dict(draft=draft, verification=Verification("exact"), sampling=Sampling(0.0), drafting=Drafting(3),
                   max_new_tokens=12)
    first = decode(target, [prompt], **options)
    assert first.stats[0].cached_tokens == 0
    follow_up = prompt + first.tokens[0] + conversation(31, 5)
    again = decode(target, [follow_up], **options)
    assert again.stats[0].cached_tokens == len(prompt) + len(first.tokens[0]) - 1  # all but the last token written
    cold = decode(LlamaCppModel(path, context=256, cache_mib=0), [follow_up], **options)
    assert again.tokens == cold.tokens


def test_a_follow_up_turn_through_the_server_is_counted_cached_unless_it_asks_not_to(path, tmp_path):
    """The official openai client sees usage.prompt_tokens_details.cached_tokens; /metrics counts the lookups
    and hits as vLLM names them; cache_prompt: false reads the whole prompt."""
    from serving import client, serving

    from diversed.models.loading import load_pair

    draft = tiny_gguf(tiny_model(0), tmp_path / "draft.gguf")
    pair = load_pair(draft, path, backend="llama.cpp")
    with serving(pair) as (url, _):
        openai = client(url)
        prompt = "abcdefghij klmnopqrst uvwxyz " * 2
        first = openai.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        follow_up = prompt + first.choices[0].text + " and then"
        second = openai.completions.create(model="tiny", prompt=follow_up, max_tokens=6, temperature=0)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert 0 < cached < second.usage.prompt_tokens
        cold = openai.completions.create(model="tiny", prompt=follow_up, max_tokens=6, temperature=0,
                                         extra_body={"cache_prompt": False})
        assert cold.usage.prompt_tokens_details.cached_tokens == 0
        assert cold.choices[0].text == second.choices[0].text
        exposition = urllib.request.urlopen(url + "/metrics").read().decode()
    hits = next(float(line.split()[-1]) for line in exposition.splitlines()
                if line.startswith("diversed:prefix_cache_hits_total"))
    queries = next(float(line.split()[-1]) for line in exposition.splitlines()
                   if line.startswith("diversed:prefix_cache_queries_total"))
    assert hits == cached and queries == first.usage.prompt_tokens + second.usage.prompt_tokens
