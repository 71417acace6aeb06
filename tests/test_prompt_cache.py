"""Each backend's prompt cache: a row that starts from a cached prefix reads only the rest of its prompt and
gets what a cold read gives, up to the backend's own batch-shape noise; the cache stays within its bound,
least recently used out; a row dropped mid-prompt leaves a cache that is still right; concurrent
conversations each keep their own prefix; the decoding loop counts what it reused."""

import urllib.request

import llama_cpp as llama
import pytest
import torch

from diversed.backends.hf import TransformersModel
from diversed.backends.llama_cpp import LlamaCppModel
from diversed.backends.prompt_cache import PromptCache, common_prefix
from diversed.decoding.engine import decode
from diversed.request import Drafting, Sampling, Verification

from tiny import tiny_gguf, tiny_model

ATOL = 2e-3  # float32 sums differ in their last bits with a pass's shape (llama.cpp; MKL's matrix kernels)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny_gguf(tiny_model(0), tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module", params=["llama.cpp", "transformers"])
def backend(request, path):
    """A function making the tiny model on one backend: (cache_mib=...) -> Model."""
    if request.param == "llama.cpp":
        return lambda **options: LlamaCppModel(path, context=256, **options)
    return lambda **options: TransformersModel(tiny_model(0), **options)


def conversation(seed: int, length: int) -> list[int]:
    return torch.randint(3, 90, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def cold_logits(make, tokens: list[int], outputs: int = 2) -> torch.Tensor:
    return make(cache_mib=0).rows(1).feed([tokens], outputs)[1][0]


def finish(model, prompts: list[list[int]]) -> None:
    """Rows that read these prompts and then leave (their KV goes to the cache)."""
    rows = model.rows(len(prompts))
    rows.feed(prompts, 1)
    rows.select([])


def test_a_cached_prefix_gives_a_cold_reads_logits(backend):
    model = backend()
    first = conversation(0, 40)
    finish(model, [first])
    follow_up = first + conversation(1, 12)
    rows = model.rows(1)
    assert rows.reuse(0, follow_up) == len(first) and rows.lengths == [len(first)]
    _, logits = rows.feed([follow_up[len(first):]], 2)
    torch.testing.assert_close(logits[0], cold_logits(backend, follow_up), atol=ATOL, rtol=0)
    # A prompt that ends where the entry ends still reads its last token (its logits are the first output).
    rows = model.rows(1)
    assert rows.reuse(0, first) == len(first) - 1


class Listed(PromptCache):
    """A prompt cache that stores its sources as they are."""

    def __init__(self, budget: int) -> None:
        super().__init__(budget)
        self.stored: dict[int, tuple] = {}

    def store(self, source, count):
        self.stored[len(self.stored)] = (source, count)
        return len(self.stored) - 1

    def release(self, key):
        self.stored[key] = None


def test_entries_keep_within_the_budget_least_recently_used_out():
    cache = Listed(budget=100)
    cache.keep([1, 2, 3] * 10, "a")  # 30
    cache.keep([4, 5] * 20, "b")  # 40
    assert cache.longest([1, 2, 3, 1, 9]) == (0, 4)  # "a" is now the most recent
    cache.keep([6] * 50, "c")  # 120 > 100: "b", the least recent, goes
    assert cache.held == 80 and list(cache.entries) == [0, 2] and cache.stored[1] is None
    cache.keep([1, 2, 3] * 12, "a+")  # extends "a": "a" goes, its extension stays
    assert list(cache.entries) == [2, 3] and cache.held == 86
    cache.keep([6] * 20, "c-")  # held already (a prefix of "c"): nothing stored
    assert len(cache.stored) == 4 and cache.stored[3] == ("a+", 36)
    cache.keep([7] * 101, "too long")  # longer than the budget: never kept, nothing evicted for it
    assert list(cache.entries) == [3, 2]


def test_the_llama_cpp_cache_keeps_within_its_bound_in_host_memory(path):
    model = LlamaCppModel(path, context=64, cache_mib=1)
    # 2 (keys, values) x 2 bytes (f16) x 2 layers x 2 KV heads x 16 per head
    assert model.kv_bytes_per_token == 256 and model.cache.budget == 2**20 // 256
    cache = model.cache
    cache.budget = 8 * 60  # eight of the prompts below
    prompts = [conversation(seed, 60) for seed in range(12)]
    for prompt in prompts:
        finish(model, [prompt])
        assert cache.held <= cache.budget and len(cache.entries) == len(cache.states) <= 8
    # Kept outside the context's cells: those hold the live rows only.
    assert llama.llama_n_ctx(model._context) == model._capacity * model.context_length
    assert [cache.longest(p)[1] for p in prompts[:4]] == [0] * 4  # the oldest went first
    assert all(cache.longest(p)[1] == 60 for p in prompts[4:])
    # After every eviction, a reused prefix still reads right.
    rows = model.rows(1)
    assert rows.reuse(0, prompts[-1] + [5, 6]) == 60
    torch.testing.assert_close(rows.feed([[5, 6]], 1)[1][0],
                               cold_logits(lambda **o: LlamaCppModel(path, context=64, **o), prompts[-1] + [5, 6], 1),
                               atol=ATOL, rtol=0)


def test_llama_cpp_cached_prompts_outlive_a_new_context(path):
    model = LlamaCppModel(path, context=64)
    history = conversation(50, 40)
    finish(model, [history])
    rows = model.rows(6)  # more rows than the context had: a new context
    turn = history + conversation(51, 3)
    assert rows.reuse(0, turn) == len(history)
    torch.testing.assert_close(rows.feed([turn[40:]] + [[3]] * 5, 1)[1][0],
                               cold_logits(lambda **o: LlamaCppModel(path, context=64, **o), turn, 1),
                               atol=ATOL, rtol=0)


def test_the_transformers_cache_holds_its_mib_in_host_memory():
    model = TransformersModel(tiny_model(0), cache_mib=1)
    # 2 (keys, values) x 2 layers x 2 KV heads x 16 per head x 4 bytes (float32)
    assert model.kv_bytes_per_token == 512 and model.cache.budget == 2**20 // 512
    finish(model, [conversation(5, 30)])
    (kv,) = model.cache.kv.values()
    assert len(kv) == 2 and all(k.device.type == "cpu" and k.shape == (2, 30, 16) for pair in kv for k in pair)
    assert TransformersModel(tiny_model(0), cache_mib=0).cache is None


def test_a_longer_turn_replaces_the_entry_it_extends(backend):
    model = backend()
    turn = conversation(2, 30)
    finish(model, [turn])
    finish(model, [turn + conversation(3, 20)])
    assert list(model.cache.entries.values()) == [turn + conversation(3, 20)]
    finish(model, [turn[:10]])  # held already
    assert len(model.cache.entries) == 1


def test_a_row_dropped_mid_prompt_leaves_a_right_cache(backend):
    model = backend()
    prompt = conversation(4, 50)
    rows = model.rows(1)
    rows.feed([prompt[:20]], 1)  # cancelled after reading part of its prompt
    rows.select([])
    rows = model.rows(1)
    assert rows.reuse(0, prompt) == 20
    torch.testing.assert_close(rows.feed([prompt[20:]], 1)[1][0], cold_logits(backend, prompt, 1), atol=ATOL,
                               rtol=0)


def test_four_conversations_each_keep_their_prefix(backend):
    model = backend()
    histories = [conversation(10 + i, 30 + 5 * i) for i in range(4)]
    finish(model, histories)
    turns = [history + conversation(20 + i, 6) for i, history in enumerate(histories)]
    rows = model.rows(4)
    assert [rows.reuse(i, turn) for i, turn in enumerate(turns)] == [len(h) for h in histories]
    _, logits = rows.feed([turn[len(h):] for turn, h in zip(turns, histories, strict=True)], 1)
    for i, turn in enumerate(turns):
        torch.testing.assert_close(logits[i], cold_logits(backend, turn, 1), atol=ATOL, rtol=0)


def test_a_row_joining_a_running_batch_takes_its_prefix_beside_the_others(backend):
    """The transformers batch is one slot layout: a cached prefix longer than it adds slots, holes for the
    rows already there, and a row already running goes on as if alone."""
    model = backend()
    history = conversation(40, 50)
    finish(model, [history])
    running = conversation(41, 8)
    rows = model.rows(1, capacity=2)
    rows.feed([running], 1)
    rows.extend(1)
    turn = history + conversation(42, 4)
    assert rows.reuse(1, turn) == len(history) and rows.lengths == [8, 50]
    _, logits = rows.feed([[7], turn[50:]], 1)
    torch.testing.assert_close(logits[0], cold_logits(backend, running + [7], 1), atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1], cold_logits(backend, turn, 1), atol=ATOL, rtol=0)


def test_the_loop_reads_only_what_the_cache_lacks_unless_told_not_to(backend):
    target, draft = backend(), backend()
    prompt = conversation(30, 40)
    options = dict(draft=draft, verification=Verification("exact"), sampling=Sampling(0.0), drafting=Drafting(3),
                   max_new_tokens=12)
    first = decode(target, [prompt], **options)
    assert first.stats[0].cached_tokens == 0
    follow_up = prompt + first.tokens[0] + conversation(31, 5)
    again = decode(target, [follow_up], **options)
    assert again.stats[0].cached_tokens == len(prompt) + len(first.tokens[0]) - 1  # all but the last token written
    cold = decode(backend(cache_mib=0), [follow_up], **options)
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


def test_a_conversation_reuses_each_turn_until_it_outgrows_the_context_then_gets_a_400():
    """A chat through the server (the tiny chat pair, transformers): every follow-up reads only what the last
    turn's prompt lacked, the answers are those of a cold prompt, and the turn that no longer fits the context
    is refused with a 400 and an error body; the server then goes on answering."""
    import openai
    from serving import client, serving, tiny_chat_pair

    with serving(tiny_chat_pair()) as (url, _):
        api = client(url)
        messages, last_prompt = [], None
        while True:
            messages.append({"role": "user", "content": " ".join(f"t{2 + (len(messages) * 7 + i) % 38}"
                                                                 for i in range(30))})
            ask = dict(model="tiny-target", messages=messages, max_tokens=8, temperature=0)
            try:
                out = api.chat.completions.create(**ask)
            except openai.BadRequestError as error:
                assert error.status_code == 400 and "context" in error.message
                break
            cold = api.chat.completions.create(**ask, extra_body={"cache_prompt": False})
            assert out.choices[0].message.content == cold.choices[0].message.content
            assert cold.usage.prompt_tokens_details.cached_tokens == 0
            # The toy template renders the history as the last prompt less its closing "t4": all of it cached.
            assert out.usage.prompt_tokens_details.cached_tokens == (last_prompt - 1 if last_prompt else 0)
            last_prompt = out.usage.prompt_tokens
            messages.append({"role": "assistant", "content": out.choices[0].message.content})
        assert len(messages) >= 9  # 256 positions hold four turns first
        out = api.chat.completions.create(model="tiny-target", messages=messages[:1], max_tokens=4, temperature=0)
        assert out.choices[0].finish_reason in ("stop", "length")


def test_the_transformers_cache_holds_a_bounded_number_of_entries():
    model = TransformersModel(tiny_model(0))
    for seed in range(model.cache.MOST_ENTRIES + 5):
        finish(model, [conversation(100 + seed, 6)])
    assert len(model.cache.entries) == len(model.cache.kv) == model.cache.MOST_ENTRIES
    held = list(model.cache.entries.values())  # the oldest went first
    assert held == [conversation(100 + seed, 6) for seed in range(5, model.cache.MOST_ENTRIES + 5)]


def test_a_pinned_entry_stays_through_extensions_and_the_budget_until_forgotten():
    cache = Listed(budget=100)
    cache.keep([1, 2, 3] * 10, "shared")
    cache.pinned = {0}
    cache.keep([1, 2, 3] * 10 + [4] * 30, "extends it")  # kept beside it
    cache.keep([5] * 60, "needs room")  # the unpinned entry goes, the pinned one stays
    assert list(cache.entries) == [0, 2] and cache.held == 90
    cache.keep([6] * 80, "no room")  # only the pinned one could go: not kept
    assert list(cache.entries) == [0] and cache.held == 30
    cache.forget([0])
    assert not cache.entries and not cache.pinned


def test_generate_over_prompts_that_share_a_system_prompt_reads_it_once():
    """`generate` (and so `diversed generate --file`): prompts decoded one after another start from what the
    earlier ones share."""
    from serving import tiny_chat_pair

    from diversed.generation import generate
    from diversed.text import encode_prompt

    pair = tiny_chat_pair()
    system = " ".join(f"t{2 + i % 38}" for i in range(60))
    prompts = ["t5 t6", "t7 t8", "t9 t10"]
    completions = generate(pair, prompts, system=system, temperature=0, max_new_tokens=4)
    ids = [encode_prompt(pair.tokenizer, p, True, system) for p in prompts]
    shared = common_prefix(ids[0], ids[1])
    assert shared > 60
    assert [c.metrics["cached_tokens"] for c in completions] == [0, shared, shared]
    cold = generate(pair, prompts, system=system, temperature=0, max_new_tokens=4, cache_prompt=False)
    assert [c.metrics["cached_tokens"] for c in cold] == [0, 0, 0]
    assert [c.text for c in cold] == [c.text for c in completions]
