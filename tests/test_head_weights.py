"""What a head learned, read back: token kinds, w and TV per token on given completions, the table by kind
and by disagreement with intervals over completions, and the report's files."""

import json

import pytest
import torch
from head_weights import (
    KINDS,
    score_completions,
    token_kind,
    token_weights,
    weights_table,
    write_weights_report,
)

from diversed.head.model import EnsembleHead, HeadConfig, build
from diversed.request import Sampling
from diversed.text import encode_prompt

from tiny import toy_pair

PROMPTS = ["t3 t9 t15", "t4 t10 t16", "t5 t11 t17", "t6 t12 t18"]
COMPLETIONS = ["t2 t7 t7 t30 t2", "t19 t5", "", "t8 t8 t8 t9 t40 t41 t3"]


@pytest.mark.parametrize("text, code, kind", [
    (" 42", False, "digits"), ("1,250.5", False, "digits"), (" +", False, "operators"),
    (" \\times", False, "operators"), (" =", True, "operators"), (" the", False, "words"),
    (" def", False, "words"), (" def", True, "keywords"),
    (" count_1", True, "code names"), ("\n    ", True, "whitespace"), ("):", True, "punctuation"),
    (" 3x", False, "other")])
def test_token_kinds(text, code, kind):
    assert token_kind(text, code) == kind


@pytest.fixture(scope="module")
def pair():
    return toy_pair()


@pytest.fixture(scope="module")
def heads(pair):
    steady = EnsembleHead(HeadConfig(pair.draft.hidden_size, pair.target.hidden_size, initial_weight=0.3))
    varied = EnsembleHead(HeadConfig(pair.draft.hidden_size, pair.target.hidden_size))
    torch.nn.init.normal_(varied.net.weight, std=0.5, generator=torch.Generator().manual_seed(0))
    return {"steady": steady, "varied": varied}


def test_every_token_gets_each_heads_w_and_the_models_tv(pair, heads):
    weights = token_weights(pair, heads, PROMPTS, COMPLETIONS, temperature=1.0, code=False)
    kept = [c for c in COMPLETIONS if c]  # the empty completion has no token to read
    tokens = [pair.tokenizer(c, add_special_tokens=False)["input_ids"] for c in kept]
    assert len(weights.text) == sum(map(len, tokens)) == len(weights.tv) == len(weights.completion)
    assert weights.completion.tolist() == [i for i, t in enumerate(tokens) for _ in t]
    assert weights.text[:2] == [pair.tokenizer.decode(t) for t in tokens[0][:2]]
    prompts = [encode_prompt(pair.tokenizer, p) for p, c in zip(PROMPTS, COMPLETIONS, strict=True) if c]
    scores = score_completions(pair, prompts, tokens, [[False] * len(t) for t in tokens], Sampling(1.0))
    mask = scores.mask
    assert torch.allclose(weights.tv, scores.tv[mask]) and (weights.tv > 0).all()
    assert torch.allclose(weights.w["varied"], heads["varied"](scores.h_draft, scores.h_target)[mask])
    assert torch.allclose(weights.w["steady"], torch.full_like(weights.tv, 0.3))
    assert weights.w["varied"].std() > 0.01


def test_a_lenience_head_is_read_as_its_L_from_the_tokens_numbers(pair, tmp_path):
    """A lenience head reads FEATURES (p(y), max p, H(p), q(y), TV) of each token as if drafted; its value is L,
    most lenient where highest, and w * TV (a mixture's expected rejection) is not its rejection."""
    config = HeadConfig(pair.draft.hidden_size, pair.target.hidden_size, kind="lenience")
    lenient = build(config)
    torch.nn.init.normal_(lenient.net.weight, std=0.5, generator=torch.Generator().manual_seed(1))
    weights = token_weights(pair, {"L": lenient}, PROMPTS, COMPLETIONS, temperature=1.0, code=False)
    kept = [c for c in COMPLETIONS if c]
    tokens = [pair.tokenizer(c, add_special_tokens=False)["input_ids"] for c in kept]
    prompts = [encode_prompt(pair.tokenizer, p) for p, c in zip(PROMPTS, COMPLETIONS, strict=True) if c]
    scores = score_completions(pair, prompts, tokens, [[False] * len(t) for t in tokens], Sampling(1.0))
    p_y, top, q_y, tv = (scores.features[..., i][scores.mask] for i in (0, 1, 3, 4))
    assert (p_y <= top + 1e-6).all() and torch.allclose(tv, weights.tv) and (q_y > 0).all()
    assert torch.allclose(weights.w["L"], lenient(None, scores.h_target, scores.features)[scores.mask])
    assert weights.lenience == {"L"} and 0 < weights.w["L"].min() and weights.w["L"].max() < 0.99
    rows = weights_table(weights)
    assert all(r["expected_rejection"] is None for r in rows)
    write_weights_report(weights, tmp_path)
    text = (tmp_path / "head_weights.md").read_text()
    assert "| L | all |" in text and "| - |" in text
    most = max(range(len(weights.text)), key=lambda i: weights.w["L"][i])
    assert f"L, highest L (most lenient): {weights.text[most]!r}" in text


def test_table_by_kind_and_disagreement_with_intervals_over_completions(pair, heads, tmp_path):
    weights = token_weights(pair, heads, PROMPTS, COMPLETIONS, temperature=1.0, code=False)
    rows = weights_table(weights)
    for name, w in weights.w.items():
        mine = {r["group"]: r for r in rows if r["head"] == name}
        everything = mine["all"]
        assert everything["tokens"] == len(w) and everything["share"] == 1.0
        assert everything["mean_w"] == pytest.approx(w.mean().item())
        assert everything["expected_rejection"] == pytest.approx((w * weights.tv).mean().item())
        assert everything["mean_w_low"] <= everything["mean_w"] + 1e-6 <= everything["mean_w_high"] + 2e-6
        # Each token is in exactly one kind, one range of positions and one TV bin.
        assert sum(r["tokens"] for g, r in mine.items() if g in KINDS) == len(w)
        assert sum(r["tokens"] for g, r in mine.items() if g.startswith("token")) == len(w)
        assert sum(r["tokens"] for g, r in mine.items() if g.startswith("TV")) == len(w)
        assert mine["token 1"]["tokens"] == 3 and mine["tokens 2-10"]["tokens"] == 4 + 2 + 6
        first = w[torch.tensor([0, 5, 8])]  # the completions' first tokens (5, 3 and 7 tokens long)
        assert mine["token 1"]["mean_w"] == pytest.approx(first.mean().item())
    steady = [r for r in rows if r["head"] == "steady"]
    assert all(r["mean_w"] == pytest.approx(0.3) for r in steady)
    assert weights_table(weights) == rows  # fixed seed: repeatable
    write_weights_report(weights, tmp_path, "# toy")
    assert json.loads((tmp_path / "head_weights.json").read_text()) == rows
    text = (tmp_path / "head_weights.md").read_text()
    assert text.startswith("# toy") and "| varied | words |" in text and "highest w (strictest)" in text
    assert (tmp_path / "head_weights.png").stat().st_size > 10_000


def test_refusals(pair, heads):
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        token_weights(pair, heads, PROMPTS[:2], COMPLETIONS[:1], temperature=1.0, code=False)
    with pytest.raises(ValueError, match="no head"):
        token_weights(pair, {}, PROMPTS, COMPLETIONS, temperature=1.0, code=False)
    with pytest.raises(ValueError, match="every completion is empty"):
        token_weights(pair, heads, PROMPTS[:1], [""], temperature=1.0, code=False)
