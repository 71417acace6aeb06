"""A draft restricted to its most frequent tokens: another draft model, so speculative decoding stays exact."""

import pytest
import torch

from diversed.decoding.engine import decode
from diversed.models.onednn import use_onednn_linears
from diversed.models.vocab import frequent_token_ids, restrict_draft_vocab
from diversed.request import Drafting, Sampling, Verification

from tiny import WORDS, perturbed, tiny_model, word_tokenizer

PROMPTS = [[2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14], [30]]


def restricted(model, count: int, onednn: bool = False):
    restrict_draft_vocab(model, word_tokenizer(), count)
    return use_onednn_linears(model) if onednn else model


def test_kept_ids_are_the_lowest_plus_the_special_tokens():
    ids = frequent_token_ids(word_tokenizer(), 5, WORDS).tolist()
    assert ids == [0, 1, 2, 3, 4]
    assert frequent_token_ids(word_tokenizer(), 100, WORDS).tolist() == list(range(WORDS))
    with pytest.raises(ValueError, match="at least 1"):
        frequent_token_ids(word_tokenizer(), 0, WORDS)


@pytest.mark.parametrize("onednn", [False, True])
def test_restricted_head_equals_the_full_head_on_kept_ids_and_excludes_the_rest(onednn):
    full = tiny_model(3, vocab=WORDS, hidden=32)
    small = restricted(tiny_model(3, vocab=WORDS, hidden=32), 12, onednn)
    ids = torch.tensor([PROMPTS[0]])
    expected, got = full(ids).logits, small(ids).logits
    assert got.shape == expected.shape
    torch.testing.assert_close(got[..., :12], expected[..., :12], atol=1e-4, rtol=1e-4)
    assert torch.isneginf(got[..., 12:]).all()


def test_speculative_decoding_with_a_restricted_draft_stays_exact_and_drafts_only_kept_tokens(monkeypatch):
    from diversed.decoding.drafters import ModelDrafter

    target = tiny_model(0, vocab=WORDS, hidden=32)
    draft = restricted(perturbed(target, 0.05, 1), 15)  # the target often wants tokens the draft cannot write
    drafted = []
    original = ModelDrafter._draft

    def spy(*args):
        out = original(*args)
        drafted.append(out[0])
        return out

    monkeypatch.setattr(ModelDrafter, "_draft", spy)
    greedy = Sampling(0)
    plain = decode(target, PROMPTS, verification=Verification("plain"), sampling=greedy, max_new_tokens=20)
    spec = decode(target, PROMPTS, draft=draft, sampling=greedy, drafting=Drafting(3), max_new_tokens=20)
    assert spec.tokens == plain.tokens and any(t >= 15 for row in plain.tokens for t in row)
    sampled = decode(target, PROMPTS, draft=draft, sampling=Sampling(1.0, top_k=10, top_p=0.9), max_new_tokens=20)
    assert all(len(t) == 20 for t in sampled.tokens)
    assert int(torch.cat([d.flatten() for d in drafted]).max()) < 15
