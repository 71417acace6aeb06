"""Training the weight head on tiny models with a word-level tokenizer: the stored rollouts, the clipped
update, which way the terms move w, and resuming after a kill."""

import json
from dataclasses import replace

import pytest
import torch
from head_weights import score_completions
from safetensors import safe_open

import diversed.head.train as train
from diversed.head.config import TrainConfig
from diversed.head.model import FEATURES, EnsembleHead, HeadConfig, LenienceHead, build
from diversed.head.ppo import ppo_terms
from diversed.head.rollouts import ROLLOUTS, Rollouts, informative_rows
from diversed.head.train import LOG_FILE, train_head
from diversed.request import Sampling, Verification
from diversed.tasks import Example
from diversed.text import encode_prompt

from tiny import ToyTask, share_of_draft_tokens, toy_pair


@pytest.fixture(scope="module")
def pair():
    return toy_pair()


DRAFT_LOVER = ToyTask(share_of_draft_tokens)


def config(**changes) -> TrainConfig:
    base = dict(lam=0.0, temperature=1.0, draft_length=3, max_new_tokens=12, lr=0.05, epochs=3,
                prompts_per_step=2, samples_per_prompt=4, checkpoint_every=2, ppo_epochs=2, minibatches=2)
    return TrainConfig(**{**base, **changes})


def log_rows(out_dir) -> list[dict]:
    return [json.loads(line) for line in (out_dir / LOG_FILE).read_text().splitlines()]


def mean_w(out_dir) -> tuple[float, float]:
    rows = log_rows(out_dir)
    return rows[0]["mean_w"], sum(r["mean_w"] for r in rows[-3:]) / 3


def synthetic(sequences: int = 4, per_sequence: int = 5, seed: int = 0) -> Rollouts:
    """Random rollouts for a head of hidden sizes (8, 12): p favours every token far more than q does."""
    g = torch.Generator().manual_seed(seed)
    n = sequences * per_sequence
    return Rollouts(h_draft=torch.randn(n, 8, generator=g).half(), h_target=torch.randn(n, 12, generator=g).half(),
                    token=torch.randint(0, 40, (n,), generator=g), p_y=torch.full((n,), 0.9),
                    q_y=torch.full((n,), 0.05), tv=torch.rand(n, generator=g), features=torch.rand(n, 5, generator=g),
                    kept=torch.arange(n) % 3 != 2, bonus=torch.arange(n) % 7 == 6,
                    old_w=torch.rand(n, generator=g), sequence=torch.arange(sequences).repeat_interleave(per_sequence),
                    reward=torch.rand(sequences, generator=g), advantage=torch.randn(sequences, generator=g),
                    mean_tv=0.5, info={"acceptance_rate": 0.5, "new_tokens": n, "seconds": 1.0, "completions": []})


def random_head(seed: int = 0) -> EnsembleHead:
    head = EnsembleHead(HeadConfig(8, 12))
    torch.manual_seed(seed)
    torch.nn.init.normal_(head.net.weight, std=0.05)  # w within about 0.5 +- 0.1
    return head


def test_stored_rollouts_round_trip_as_safetensors_and_json(tmp_path):
    rollouts = synthetic()
    rollouts.save(tmp_path, 12)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000012.json", "step-000012.safetensors"]
    with safe_open(tmp_path / "step-000012.safetensors", "pt") as f:  # plain safetensors: no pickle anywhere
        assert "h_draft" in f.keys() and f.get_tensor("h_draft").dtype == torch.float16
    loaded = Rollouts.load(tmp_path, 12)
    for name in ("h_draft", "h_target", "token", "p_y", "q_y", "tv", "bonus", "old_w", "sequence", "reward",
                 "advantage"):
        original, back = getattr(rollouts, name), getattr(loaded, name)
        assert back.dtype == original.dtype and torch.equal(back, original), name
    assert loaded.mean_tv == rollouts.mean_tv and loaded.info == rollouts.info
    assert Rollouts.load(tmp_path, 13) is None


def test_a_minibatch_keeps_its_sequences_tokens_renumbered():
    rollouts = synthetic()
    part = rollouts.select(torch.tensor([3, 1]))
    assert part.sequence.tolist() == [0] * 5 + [1] * 5  # in their order: sequence 1, then 3
    assert torch.equal(part.h_draft[5:], rollouts.h_draft[15:]) and torch.equal(part.reward, rollouts.reward[[1, 3]])
    # The acceptance term averages per sequence over its scored (not bonus) tokens, then over sequences: a
    # minibatch's is its own sequences'.
    tv, scored = rollouts.tv.view(4, 5)[[1, 3]], ~rollouts.bonus.view(4, 5)[[1, 3]]
    torch.testing.assert_close(part.per_sequence_mean(part.tv), ((tv * scored).sum(-1) / scored.sum(-1)).mean())


def test_the_summary_reads_w_over_scored_tokens_at_each_completions_first_token_and_by_disagreement():
    rollouts = synthetic()
    summary = rollouts.summary(rollouts.old_w * rollouts.tv)
    assert summary["acceptance"] == pytest.approx(rollouts.per_sequence_mean(1 - rollouts.old_w * rollouts.tv).item())
    assert summary["first_w"] == pytest.approx(rollouts.old_w[[0, 5, 10, 15]].mean().item())
    assert summary["mean_w"] == pytest.approx(rollouts.old_w[~rollouts.bonus].mean().item())
    scored = [i for i in range(20) if i % 7 != 6]
    w, tv = rollouts.old_w.tolist(), rollouts.tv.tolist()
    assert summary["disagreement_w"] == pytest.approx(sum(w[i] * tv[i] for i in scored) / sum(tv[i] for i in scored))
    # Where the models disagree on one token only, the w there is the TV-weighted mean.
    one = replace(rollouts, tv=torch.zeros(20).index_fill_(0, torch.tensor([3]), 0.9))
    assert one.summary(one.old_w * one.tv)["disagreement_w"] == pytest.approx(rollouts.old_w[3].item())


@pytest.mark.parametrize("above", [True, False])
def test_the_clip_stops_the_policy_gradient_only_on_the_side_it_guards(above):
    """r > 1 + eps with A > 0, or r < 1 - eps with A < 0, would push r further out: zero gradient there.
    Pulling back towards the band keeps its gradient."""
    head, rollouts = random_head(), synthetic()
    # p_y >> q_y, so nu grows with w: a sampling w far below (above) the head's gives a ratio far above (below) 1.
    rollouts.old_w = torch.full_like(rollouts.old_w, 0.01 if above else 0.99)
    for sign, clipped in ((1.0, above), (-1.0, not above)):
        rollouts.advantage = sign * torch.ones(4)
        terms = ppo_terms(head, rollouts, lam=0.0, clip=0.2)
        assert terms.clip_fraction == 1.0
        grad = torch.autograd.grad(terms.pg_loss, head.net.weight)[0]
        assert (grad.abs().max() == 0) if clipped else (grad.abs().max() > 1e-3)


def test_with_a_ratio_of_one_the_update_is_reinforce_and_the_clip_does_not_act():
    head, rollouts = random_head(), synthetic()
    with torch.no_grad():
        rollouts.old_w = head(rollouts.h_draft.float(), rollouts.h_target.float())
    grads = [torch.autograd.grad(ppo_terms(head, rollouts, lam=0.0, clip=clip).pg_loss, head.net.weight)[0]
             for clip in (0.01, 100.0)]
    w = head(rollouts.h_draft.float(), rollouts.h_target.float())
    log_nu = torch.log(w * rollouts.p_y + (1 - w) * rollouts.q_y)
    reinforce = -(rollouts.advantage[rollouts.sequence] * log_nu * ~rollouts.bonus).sum() / 4
    expected = torch.autograd.grad(reinforce, head.net.weight)[0]
    for grad in grads:
        torch.testing.assert_close(grad, expected)


def test_a_lenience_heads_update_is_reinforce_on_the_verdicts():
    """At the sampling head a lenience head's policy gradient is -(1/S) sum A sum_t grad log P(verdict_t),
    P = a_t = min(1, p(x) / ((1 - L_t) q(x))) where the draft was kept, 1 - a_t where it was rejected; its
    acceptance term raises L (a_t grows with L)."""
    head = build(HeadConfig(8, 12, kind="lenience"))
    torch.manual_seed(0)
    torch.nn.init.normal_(head.net.weight, std=0.05)
    rollouts = synthetic()
    rollouts.features[:, FEATURES.index("p(x)")] = 0.05  # the draft far likelier than the target: a_t < 1
    rollouts.features[:, FEATURES.index("q(x)")] = 0.9
    with torch.no_grad():
        rollouts.old_w = head(None, rollouts.h_target.float(), rollouts.features)
    terms = ppo_terms(head, rollouts, lam=0.0, clip=0.01)
    grad = torch.autograd.grad(terms.pg_loss, head.net.weight)[0]
    lenience = head(None, rollouts.h_target.float(), rollouts.features)
    passed = (0.05 / ((1 - lenience) * 0.9)).clamp(max=1.0)
    log_verdict = torch.log(torch.where(rollouts.kept, passed, 1 - passed))
    reinforce = -(rollouts.advantage[rollouts.sequence] * log_verdict * ~rollouts.bonus).sum() / 4
    torch.testing.assert_close(grad, torch.autograd.grad(reinforce, head.net.weight)[0])
    acceptance = ppo_terms(head, rollouts, lam=1.0, clip=0.2).acceptance_term
    bias = torch.autograd.grad(acceptance, head.net.bias)[0]
    assert bias.item() < 0  # a descent step raises the logit of L


@pytest.mark.parametrize("kind", ["lenience", "lenience-target"])
def test_a_lenience_head_trains_a_step_and_its_rollouts_keep_the_verdicts(pair, tmp_path, kind):
    head = train_head(pair, DRAFT_LOVER, config(kind=kind, lam=0.5, max_lenience=0.9), tmp_path, until_step=1,
                      progress=False)
    assert type(head) is LenienceHead and json.loads((tmp_path / "head.json").read_text())["kind"] == kind
    row, = log_rows(tmp_path)
    assert row["mean_w"] == pytest.approx(0.5) and row["updates"] == 4 and row["approx_kl"] >= 0
    assert 0 < row["acceptance"] <= 1 and row["acceptance_grad_norm"] > 0
    stored = Rollouts.load(tmp_path / ROLLOUTS, 1)
    scored = ~stored.bonus
    rejected = scored & ~stored.kept
    assert rejected.any() and (scored & stored.kept).any()
    # Where the draft was kept it is the token; where it was rejected, the correction is another token.
    for name, emitted in (("p(x)", stored.p_y), ("q(x)", stored.q_y)):
        column = stored.features[:, FEATURES.index(name)]
        torch.testing.assert_close(column[scored & stored.kept], emitted[scored & stored.kept])
    assert not torch.allclose(stored.features[rejected, FEATURES.index("q(x)")], stored.q_y[rejected])
    assert type(EnsembleHead.load(tmp_path)) is LenienceHead


class EchoTask(ToyTask):
    """The toy task whose examples carry their prompt as the input text a prediction repeats."""

    def examples(self, split: str = "train", limit: int | None = None) -> list[Example]:
        return [replace(e, metadata={"original": e.prompt}) for e in super().examples(split, limit)]


@pytest.mark.parametrize("drafter", ["lookup", "prediction"])
def test_a_target_only_head_trains_on_copied_drafts_and_its_rollouts_cover_every_token(pair, tmp_path, drafter):
    task = EchoTask(share_of_draft_tokens, size=2)
    cfg = config(kind="lenience-target", drafter=drafter, lam=0.5, max_lenience=0.9, epochs=1)
    head = train_head(pair, task, cfg, tmp_path, until_step=1, progress=False)
    assert type(head) is LenienceHead
    stored = Rollouts.load(tmp_path / ROLLOUTS, 1)
    assert len(stored.token) == stored.info["new_tokens"]
    scored = ~stored.bonus
    assert scored.any() and stored.bonus.any()
    # A copied draft is a point mass: q(x) = 1 and TV = 1 - p(x), wherever a draft was verified.
    torch.testing.assert_close(stored.features[scored, FEATURES.index("q(x)")], torch.ones(int(scored.sum())))
    torch.testing.assert_close(stored.tv[scored], 1 - stored.features[scored, FEATURES.index("p(x)")])
    assert stored.h_draft.shape[-1] == 0  # nothing of the draft model is read
    row, = log_rows(tmp_path)
    assert row["updates"] > 0 and 0 < row["acceptance"] <= 1


def test_a_trace_keeps_the_tokens_of_a_step_of_the_target_alone_as_bonus_tokens(pair):
    """Copying drafters propose nothing in some rounds: those tokens come from a step of the target alone,
    which calls on_round without a Round. The trace keeps them as bonus tokens: its bonus tokens are the tokens
    the target decided alone."""
    traces = [train.Trace(32, torch.device("cpu")) for _ in range(2)]
    calls = {"steps": 0, "rounds": 0}

    def on_round(i, result, row, count):
        calls["steps" if result is None else "rounds"] += 1
        traces[i].add(result, row, count)

    # The first prompt repeats itself, so lookup proposes; the second does not, at first.
    generation = train.decode(pair.target, [[3, 4, 5, 3, 4, 5, 3, 4], [7, 8, 9]], draft=pair.draft,
                              drafter="lookup", verification=Verification("exact"), sampling=Sampling(1.0),
                              draft_length=3, max_new_tokens=16, seed=0, on_round=on_round)
    assert calls["rounds"] > 0 and calls["steps"] > 0  # speculative rounds, and steps of the target alone
    for trace, tokens, stats in zip(traces, generation.tokens, generation.stats, strict=True):
        *_, kept, bonus = trace.tensors()
        assert len(bonus) == len(tokens) and int(bonus.sum()) == stats.target_tokens
        assert int(kept.sum()) == stats.accepted


def test_copied_drafts_train_only_a_lenience_head():
    with pytest.raises(ValueError, match="mixture head reads the draft model's hidden states"):
        config(drafter="lookup")
    with pytest.raises(ValueError, match="drafter must be one of"):
        config(kind="lenience-target", drafter="auto")


def test_a_warm_start_refuses_a_head_of_another_kind(uninterrupted):
    _, out = uninterrupted
    with pytest.raises(ValueError, match="is 'mixture', this run trains 'lenience': pass --kind mixture"):
        config(kind="lenience", init_head=str(out))


def test_one_update_is_the_reinforce_gradient_of_the_stored_rollouts(pair, tmp_path):
    """ppo_epochs = 1, one minibatch: the update's gradient is that of -(R - b) sum_t log nu_t - lambda' A(y)
    (the objective before PPO; lambda' = lambda / mean TV), recomputed here from the models."""
    task, lam = ToyTask(share_of_draft_tokens, size=2), 0.5
    cfg = config(epochs=1, ppo_epochs=1, minibatches=1, clip=100.0, grad_clip=1e9, lam=lam)
    trained = train_head(pair, task, cfg, tmp_path, progress=False)
    stored = Rollouts.load(tmp_path / ROLLOUTS, 1)
    assert {p.suffix for p in tmp_path.rglob("*") if p.is_file()} == {".json", ".jsonl", ".safetensors"}

    examples = {e.id: e for e in task.examples()}
    completions = stored.info["completions"]
    prompts = [encode_prompt(pair.tokenizer, examples[c["example"]].prompt) for c in completions]
    tokens = [stored.token[stored.sequence == i].tolist() for i in range(len(completions))]
    bonus = [stored.bonus[stored.sequence == i].tolist() for i in range(len(completions))]
    # What the decoding kept at each token is what a teacher-forced pass of both models over the text gives; a
    # bonus token (from p after a fully kept round) had no draft: zeros for its draft state, q(y) = p(y), TV 0.
    scores = score_completions(pair, prompts, tokens, bonus, Sampling(1.0))
    h_d, h_t, p_y, q_y, tv, mask, scored = (scores.h_draft, scores.h_target, scores.p_y, scores.q_y, scores.tv,
                                            scores.mask, scores.scored)
    kept = scored[mask]
    assert stored.bonus.tolist() == (~kept).tolist() and 0 < stored.bonus.sum() < len(kept)
    for name, value in (("p_y", p_y), ("q_y", q_y), ("tv", tv), ("h_draft", h_d.half()), ("h_target", h_t.half())):
        torch.testing.assert_close(getattr(stored, name)[kept], value[mask][kept], msg=name, atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(stored.p_y, p_y[mask], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(stored.h_target, h_t.half()[mask], atol=2e-3, rtol=1e-3)
    assert torch.equal(stored.q_y[~kept], stored.p_y[~kept]) and (stored.tv[~kept] == 0).all()
    assert (stored.h_draft[~kept] == 0).all()
    assert stored.mean_tv == pytest.approx(tv[scored].mean().item(), rel=1e-4)
    rewards = torch.tensor([share_of_draft_tokens(c["text"]) for c in completions])
    torch.testing.assert_close(stored.reward, rewards)

    head = EnsembleHead(trained.config)  # the sampling head: the initial one
    w = head(stored.h_draft.float(), stored.h_target.float())
    baseline = (rewards.view(-1, 4).sum(-1, keepdim=True) - rewards.view(-1, 4)) / 3
    per_sequence = torch.zeros(len(completions)).index_add
    log_nu = per_sequence(0, stored.sequence, torch.log(torch.where(
        kept, w * stored.p_y + (1 - w) * stored.q_y, 1.0)))
    acceptance = (per_sequence(0, stored.sequence, (1 - w * stored.tv) * kept)
                  / per_sequence(0, stored.sequence, kept.float()))
    loss = (-(rewards - baseline.view(-1)) * log_nu - lam / stored.mean_tv * acceptance).mean()
    loss.backward()
    assert log_rows(tmp_path)[0]["updates"] == 1
    for (name, expected), applied in zip(head.named_parameters(), trained.parameters(), strict=True):
        torch.testing.assert_close(applied.grad, expected.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_acceptance_reward_alone_moves_w_down(pair, tmp_path):
    """With a constant task reward the advantage is 0 and only the acceptance term acts: raising it means
    lowering w where TV > 0."""
    train_head(pair, ToyTask(lambda text: 1.0), config(lam=1.0, epochs=2, lr=0.01), tmp_path, progress=False)
    first, last = mean_w(tmp_path)
    assert first == pytest.approx(0.5, abs=1e-6) and last < 0.35
    rows = log_rows(tmp_path)
    assert all(r["pg_grad_norm"] == 0 and r["acceptance_grad_norm"] > 0 for r in rows)
    # The fresh head gives every token the same w; the trained one tells the tokens apart.
    assert rows[0]["w_std"] == pytest.approx(0.0, abs=1e-6) and max(r["w_std"] for r in rows) > 0.01


def test_informative_rows_are_the_completions_of_prompts_whose_samples_rewards_differ():
    rewards = torch.tensor([1.0, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0.5, 0.5, 0.5, 0.25])
    assert informative_rows(rewards, 4).tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    assert informative_rows(torch.ones(6), 3).tolist() == []


def test_informative_only_leaves_the_head_alone_where_the_reward_cannot_object(pair, tmp_path):
    """A constant reward: every step is without reward signal, so with informative_only no update happens at
    all, where without it the acceptance term alone moves w down (test above)."""
    train_head(pair, ToyTask(lambda text: 1.0), config(lam=1.0, epochs=2, lr=0.01, informative_only=True), tmp_path,
               progress=False)
    rows = log_rows(tmp_path)
    assert all(r["trained_on"] == 0 and r["updates"] == 0 for r in rows)
    assert all(r["mean_w"] == pytest.approx(0.5, abs=1e-6) for r in rows)


def test_informative_only_updates_on_the_prompts_with_a_reward_difference(pair, tmp_path):
    train_head(pair, DRAFT_LOVER, config(informative_only=True, epochs=1), tmp_path, progress=False)
    rows = log_rows(tmp_path)
    assert all(r["trained_on"] in (0, 4, 8) for r in rows) and any(r["trained_on"] > 0 for r in rows)
    assert all((r["updates"] > 0) == (r["trained_on"] > 0) for r in rows)


@pytest.mark.parametrize("prefer_draft", [True, False])
def test_the_reward_moves_w_towards_the_rewarded_model(pair, tmp_path, prefer_draft):
    """A reward for draft-favoured tokens must lower w (trust the draft); one for target-favoured tokens must
    raise it. lambda = 0, so only the policy gradient moves the head."""
    task = DRAFT_LOVER if prefer_draft else ToyTask(lambda text: 1.0 - share_of_draft_tokens(text))
    train_head(pair, task, config(), tmp_path, progress=False)
    _, last = mean_w(tmp_path)
    assert (last < 0.4) if prefer_draft else (last > 0.6)


@pytest.fixture(scope="module")
def uninterrupted(pair, tmp_path_factory):
    """A 3-step run (checkpoints at steps 0, 2 and 3; 4 updates a step) that the resume tests must reproduce."""
    out = tmp_path_factory.mktemp("uninterrupted")
    return train_head(pair, DRAFT_LOVER, config(epochs=1, lam=0.5), out, progress=False), out


def test_the_log_reports_both_terms_and_the_update(uninterrupted):
    _, out = uninterrupted
    for row in log_rows(out):
        for key in ("reward", "acceptance", "acceptance_rate", "mean_w", "w_std", "first_w", "disagreement_w",
                    "mean_tv", "pg_loss", "acceptance_term", "loss", "pg_grad_norm", "acceptance_grad_norm",
                    "grad_norm", "clip_fraction", "approx_kl", "updates"):
            assert key in row, key
        assert row["loss"] == pytest.approx(row["pg_loss"] + row["acceptance_term"])
        assert row["acceptance_grad_norm"] > 0 and row["updates"] == 4 and row["approx_kl"] >= 0


# (function of diversed.head.train that dies, on which call, after it returns or before, steps decoded on resume)
KILLS = {
    "after step 1's rollouts, before any update and any checkpoint but step 0's": ("_update", 1, False, 2),
    "after step 3's rollouts, before its updates": ("_update", 3, False, 0),
    "mid-epoch in step 3's updates": ("ppo_terms", 13, False, 0),  # 5 calls a step: 4 updates, the final KL
    "right after step 2's checkpoint": ("_checkpoint", 2, True, 1),
}


@pytest.mark.parametrize("kill", KILLS.values(), ids=KILLS.keys())
def test_resume_after_a_kill_gives_the_uninterrupted_run(pair, tmp_path, monkeypatch, uninterrupted, kill):
    name, call, after, decoded = kill
    full, full_out = uninterrupted
    original, calls = getattr(train, name), {"n": 0}

    def dies(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call and not after:
            raise KeyboardInterrupt
        result = original(*args, **kwargs)
        if calls["n"] == call:
            raise KeyboardInterrupt
        return result

    monkeypatch.setattr(train, name, dies)
    with pytest.raises(KeyboardInterrupt):
        train_head(pair, DRAFT_LOVER, config(epochs=1, lam=0.5), tmp_path, progress=False)
    monkeypatch.setattr(train, name, original)

    decode, decodes = train.decode, {"n": 0}

    def counted(*args, **kwargs):
        decodes["n"] += 1
        return decode(*args, **kwargs)

    monkeypatch.setattr(train, "decode", counted)
    resumed = train_head(pair, DRAFT_LOVER, config(epochs=1, lam=0.5), tmp_path, resume=True, progress=False)
    assert decodes["n"] == decoded  # stored rollouts are never sampled again
    for key, value in full.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[key], value, rtol=0, atol=0)
    timeless = [{k: v for k, v in row.items() if not k.endswith("seconds")} for row in log_rows(full_out)]
    assert [{k: v for k, v in row.items() if not k.endswith("seconds")} for row in log_rows(tmp_path)] == timeless


def test_a_run_stopped_at_a_step_and_resumed_is_the_uninterrupted_run(pair, tmp_path, uninterrupted):
    full, full_out = uninterrupted
    partial = train_head(pair, DRAFT_LOVER, config(epochs=1, lam=0.5), tmp_path, until_step=1, progress=False)
    assert len(log_rows(tmp_path)) == 1 and partial.config.training["steps"] == 1
    assert json.loads((tmp_path / "head.json").read_text())["training"]["total_steps"] == 3
    with open(tmp_path / "log.jsonl", "a") as log:
        log.write('{"step": 2, "rew')  # a line a kill cut short, after the checkpoint
    resumed = train_head(pair, DRAFT_LOVER, config(epochs=1, lam=0.5), tmp_path, resume=True, progress=False)
    assert resumed.config.training["steps"] == 3 and len(log_rows(tmp_path)) == 3
    for key, value in full.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[key], value, rtol=0, atol=0)
    with pytest.raises(ValueError, match="until_step must be >= 1"):
        train_head(pair, DRAFT_LOVER, config(epochs=1), tmp_path / "other", until_step=0, progress=False)


def test_a_kill_during_a_checkpoint_leaves_the_previous_one_whole(pair, tmp_path, monkeypatch, uninterrupted):
    original, calls = train.save_file, {"n": 0}

    def dies_on_third(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # killed while writing the checkpoint of step 3 (after those of 0 and 2)
        return original(*args, **kwargs)

    monkeypatch.setattr(train, "save_file", dies_on_third)
    with pytest.raises(KeyboardInterrupt):
        train_head(pair, DRAFT_LOVER, config(epochs=1, lam=0.5), tmp_path, progress=False)
    monkeypatch.setattr(train, "save_file", original)
    resumed = train_head(pair, DRAFT_LOVER, config(epochs=1, lam=0.5), tmp_path, resume=True, progress=False)
    for name, value in uninterrupted[0].state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], value, rtol=0, atol=0)


def test_fresh_run_refuses_to_overwrite_and_resume_refuses_other_config(pair, tmp_path):
    small = ToyTask(share_of_draft_tokens, size=2)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train_head(pair, small, config(epochs=1), tmp_path, resume=True, progress=False)
    train_head(pair, small, config(epochs=1, prompts_per_step=1), tmp_path, progress=False)
    with pytest.raises(ValueError, match="already holds"):
        train_head(pair, small, config(epochs=1), tmp_path, progress=False)
    with pytest.raises(ValueError, match="changed: clip, lr"):
        train_head(pair, small, config(epochs=1, prompts_per_step=1, lr=0.1, clip=0.3), tmp_path, resume=True,
                   progress=False)


def test_a_run_saved_before_a_setting_existed_resumes_with_its_default(pair, tmp_path):
    small = ToyTask(share_of_draft_tokens, size=2)
    train_head(pair, small, config(epochs=1, prompts_per_step=1), tmp_path, until_step=1, progress=False)
    state_file = next(tmp_path.rglob("train_state.json"))
    state = json.loads(state_file.read_text())
    del state["config"]["informative_only"]
    state_file.write_text(json.dumps(state))
    train.check_run_folder(tmp_path, config(epochs=1, prompts_per_step=1), resume=True)
    with pytest.raises(ValueError, match="changed: informative_only"):
        train.check_run_folder(tmp_path, config(epochs=1, prompts_per_step=1, informative_only=True), resume=True)


def test_scoring_matches_the_models(pair):
    """The teacher-forced pass gives p(y_t), q(y_t) and TV at the positions that predict each token."""
    prompts, completions = [[3, 4, 5], [6]], [[7, 8], [9, 10, 11]]
    scores = score_completions(pair, prompts, completions, [[False, True], [False, False, False]], Sampling(1.0))
    h_d, h_t, p_y, q_y, tv, mask, scored = (scores.h_draft, scores.h_target, scores.p_y, scores.q_y, scores.tv,
                                            scores.mask, scores.scored)
    assert mask.tolist() == [[True, True, False], [True, True, True]]
    assert scored.tolist() == [[True, False, False], [True, True, True]]
    with torch.no_grad():
        seq = torch.tensor([[6, 9, 10, 11]])
        p = torch.softmax(pair.target.model(seq).logits[0], -1)
        q = torch.softmax(pair.draft.model(seq).logits[0], -1)
    torch.testing.assert_close(p_y[1], p[[0, 1, 2], [9, 10, 11]], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(q_y[1], q[[0, 1, 2], [9, 10, 11]], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(tv[1], 0.5 * (p[:3] - q[:3]).abs().sum(-1), atol=1e-5, rtol=1e-4)
    assert h_d.shape == (2, 3, 48) and h_t.shape == (2, 3, 32)


def test_bad_training_settings_are_refused():
    for bad, message in ((dict(checkpoint_every=0), "checkpoint_every"), (dict(lr=0), "lr"),
                         (dict(samples_per_prompt=1), "samples_per_prompt"), (dict(temperature=0), "temperature"),
                         (dict(lam=-1), "lambda"), (dict(limit=0), "limit"), (dict(ppo_epochs=0), "ppo_epochs"),
                         (dict(clip=0), "clip"), (dict(minibatches=9), "minibatches"), (dict(kind="bound"), "kind"),
                         (dict(max_lenience=1.0), "max lenience"), (dict(initial_lenience=0.0), "initial"),
                         (dict(max_lenience=float("nan")), "max_lenience")):
        with pytest.raises(ValueError, match=message):
            config(**bad)


def test_a_warm_start_begins_from_the_given_head(pair, tmp_path, uninterrupted):
    """--init-head: the first step samples with the given head's weights, not the fresh head's w = 0.5; a
    checkpoint folder gives its optimizer state too."""
    trained, trained_out = uninterrupted
    first_of_trained = log_rows(trained_out)[0]["mean_w"]
    assert first_of_trained == pytest.approx(0.5, abs=1e-6)
    run = train_head(pair, DRAFT_LOVER, config(epochs=1, lam=0.5, init_head=str(trained_out)), tmp_path,
                     until_step=1, progress=False)
    assert log_rows(tmp_path)[0]["mean_w"] < 0.45  # the draft lover's head already trusts the draft
    assert run.config.training["init_head"] == str(trained_out)
    resumed = train_head(pair, DRAFT_LOVER, config(epochs=1, lam=0.5, init_head=str(trained_out)), tmp_path,
                         resume=True, progress=False)  # from its own checkpoint, not the start head again
    assert len(log_rows(tmp_path)) == 3 and resumed.config.training["steps"] == 3
    # From a checkpoint folder the AdamW moments come too: its 12 updates (3 steps x 4) count on.
    steps = {}
    for name, start in (("head", trained_out), ("checkpoint", trained_out / "checkpoint")):
        train_head(pair, DRAFT_LOVER, config(epochs=1, lam=0.5, init_head=str(start)), tmp_path / ("from-" + name),
                   until_step=1, progress=False)
        state = json.loads((tmp_path / ("from-" + name) / "checkpoint" / "train_state.json").read_text())
        steps[name] = state["optimizer_scalars"]["0.step"]
    assert steps == {"head": 4, "checkpoint": 16}
    with pytest.raises(FileNotFoundError, match="no head checkpoint"):
        config(init_head=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="pass --architecture linear"):
        config(init_head=str(trained_out), architecture="mlp")
