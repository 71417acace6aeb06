"""The weight head and its training, on tiny models with a word-level tokenizer."""

import json

import pytest
import torch

from diversed.decoding.sampling import Sampling
from diversed.head.model import EnsembleHead, HeadConfig
from diversed.head.train import LOG_FILE, TrainConfig, score_completions, train_head

from tiny import ToyTask, share_of_draft_tokens, toy_pair


@pytest.fixture(scope="module")
def pair():
    return toy_pair()


DRAFT_LOVER = ToyTask(share_of_draft_tokens)


def config(**changes) -> TrainConfig:
    base = dict(lam=0.0, temperature=1.0, draft_len=3, max_new_tokens=12, lr=0.05, epochs=3,
                prompts_per_step=2, samples_per_prompt=4, checkpoint_every=2)
    return TrainConfig(**{**base, **changes})


def mean_w(log_path) -> tuple[float, float]:
    rows = [json.loads(line) for line in log_path.read_text().splitlines()]
    return rows[0]["mean_w"], sum(r["mean_w"] for r in rows[-3:]) / 3


def test_head_starts_at_its_initial_weight_for_any_input():
    for w0 in (0.5, 0.8):
        for architecture in ("linear", "mlp"):
            head = EnsembleHead(HeadConfig(8, 12, architecture, initial_weight=w0))
            w = head(torch.randn(5, 3, 8) * 10, torch.randn(5, 3, 12))
            assert w.shape == (5, 3) and w.dtype == torch.float32
            torch.testing.assert_close(w, torch.full((5, 3), w0))


def test_head_refuses_wrong_hidden_sizes():
    head = EnsembleHead(HeadConfig(8, 12))
    with pytest.raises(ValueError, match="hidden sizes"):
        head(torch.randn(2, 8), torch.randn(2, 13))


def test_save_and_load_round_trip_and_refusals(tmp_path):
    head = EnsembleHead(HeadConfig(8, 12, "mlp", draft_model="d", target_model="t"))
    torch.nn.init.normal_(head.net[0].weight)
    head.save(tmp_path)
    loaded = EnsembleHead.load(tmp_path, draft_hidden=8, target_hidden=12, draft_model="d")
    x, y = torch.randn(4, 8), torch.randn(4, 12)
    assert torch.equal(head(x, y), loaded(x, y))
    with pytest.raises(ValueError, match="target hidden size"):
        EnsembleHead.load(tmp_path, target_hidden=1536)
    with pytest.raises(ValueError, match="draft model"):
        EnsembleHead.load(tmp_path, draft_model="other")
    (tmp_path / "head.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="corrupt head weights"):
        EnsembleHead.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="head.json"):
        EnsembleHead.load(tmp_path / "missing")


def test_acceptance_reward_alone_moves_w_down(pair, tmp_path):
    """With a constant task reward, the loss is -lambda * A, and raising A means lowering w where TV > 0."""
    train_head(pair, ToyTask(lambda text: 1.0), config(lam=1.0, epochs=2), tmp_path, progress=False)
    first, last = mean_w(tmp_path / LOG_FILE)
    assert first == pytest.approx(0.5, abs=1e-6) and last < 0.35
    rows = [json.loads(line) for line in (tmp_path / LOG_FILE).read_text().splitlines()]
    # The fresh head gives every token the same w; the trained one tells the tokens apart.
    assert rows[0]["w_std"] == pytest.approx(0.0, abs=1e-6) and rows[-1]["w_std"] > 0.01


@pytest.mark.parametrize("prefer_draft", [True, False])
def test_reinforce_moves_w_towards_the_rewarded_model(pair, tmp_path, prefer_draft):
    """A reward for draft-favoured tokens must lower w (trust the draft); one for target-favoured tokens must
    raise it. lambda = 0, so only REINFORCE moves the head."""
    task = DRAFT_LOVER if prefer_draft else ToyTask(lambda text: 1.0 - share_of_draft_tokens(text))
    train_head(pair, task, config(), tmp_path, progress=False)
    _, last = mean_w(tmp_path / LOG_FILE)
    assert (last < 0.4) if prefer_draft else (last > 0.6)


def test_resume_after_a_kill_gives_the_same_head(pair, tmp_path):
    cfg = config(epochs=1)  # 3 steps, checkpoints after steps 2 and 3
    full = train_head(pair, DRAFT_LOVER, cfg, tmp_path / "full", progress=False)
    killed = tmp_path / "killed"
    _train_steps(pair, cfg, killed, steps=2)
    resumed = train_head(pair, DRAFT_LOVER, cfg, killed, resume=True, progress=False)
    for name, value in full.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], value)
    full_log = (tmp_path / "full" / LOG_FILE).read_text().splitlines()
    resumed_log = (killed / LOG_FILE).read_text().splitlines()
    assert [json.loads(x)["reward"] for x in full_log] == [json.loads(x)["reward"] for x in resumed_log]


def _train_steps(pair, cfg, out_dir, steps):
    """Run a training that is killed when its step `steps` + 1 begins."""
    import diversed.head.train as train

    original = train._step
    calls = {"n": 0}

    def step_then_die(*args, **kwargs):
        if calls["n"] == steps:
            raise KeyboardInterrupt
        calls["n"] += 1
        return original(*args, **kwargs)

    train._step = step_then_die
    try:
        with pytest.raises(KeyboardInterrupt):
            train_head(pair, DRAFT_LOVER, cfg, out_dir, progress=False)
    finally:
        train._step = original


def test_fresh_run_refuses_to_overwrite_and_resume_refuses_other_config(pair, tmp_path):
    train_head(pair, ToyTask(share_of_draft_tokens, size=2), config(epochs=1, prompts_per_step=1), tmp_path,
               progress=False)
    with pytest.raises(ValueError, match="already holds"):
        train_head(pair, ToyTask(share_of_draft_tokens, size=2), config(epochs=1), tmp_path, progress=False)
    with pytest.raises(ValueError, match="lr"):
        train_head(pair, ToyTask(share_of_draft_tokens, size=2), config(epochs=1, prompts_per_step=1, lr=0.1),
                   tmp_path, resume=True, progress=False)


def test_scoring_matches_the_models(pair):
    """The teacher-forced pass gives p(y_t), q(y_t) and TV at the positions that predict each token."""
    prompts, completions = [[3, 4, 5], [6]], [[7, 8], [9, 10, 11]]
    h_d, h_t, p_y, q_y, tv, mask, scored = score_completions(
        pair, prompts, completions, [[False, True], [False, False, False]], Sampling(1.0))
    assert mask.tolist() == [[True, True, False], [True, True, True]]
    assert scored.tolist() == [[True, False, False], [True, True, True]]
    with torch.no_grad():
        seq = torch.tensor([[6, 9, 10, 11]])
        p = torch.softmax(pair.target(seq).logits[0], -1)
        q = torch.softmax(pair.draft(seq).logits[0], -1)
    torch.testing.assert_close(p_y[1], p[[0, 1, 2], [9, 10, 11]], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(q_y[1], q[[0, 1, 2], [9, 10, 11]], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(tv[1], 0.5 * (p[:3] - q[:3]).abs().sum(-1), atol=1e-5, rtol=1e-4)
    assert h_d.shape == (2, 3, 48) and h_t.shape == (2, 3, 32)


def test_a_kill_during_a_checkpoint_leaves_the_previous_one_whole(pair, tmp_path, monkeypatch):
    import diversed.head.train as train

    cfg = config(epochs=1, checkpoint_every=1)
    full = train_head(pair, DRAFT_LOVER, cfg, tmp_path / "full", progress=False)
    original, calls = train.save_file, {"n": 0}

    def dies_on_second(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # killed while writing the second checkpoint
        return original(*args, **kwargs)

    monkeypatch.setattr(train, "save_file", dies_on_second)
    with pytest.raises(KeyboardInterrupt):
        train_head(pair, DRAFT_LOVER, cfg, tmp_path / "killed", progress=False)
    monkeypatch.setattr(train, "save_file", original)
    resumed = train_head(pair, DRAFT_LOVER, cfg, tmp_path / "killed", resume=True, progress=False)
    for name, value in full.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], value)


def test_a_run_killed_before_its_first_checkpoint_is_not_silently_appended_to(pair, tmp_path):
    _train_steps(pair, config(epochs=1, checkpoint_every=5), tmp_path, steps=1)
    assert (tmp_path / LOG_FILE).exists() and not (tmp_path / "checkpoint").exists()
    with pytest.raises(ValueError, match="already holds"):
        train_head(pair, DRAFT_LOVER, config(epochs=1), tmp_path, progress=False)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train_head(pair, DRAFT_LOVER, config(epochs=1, checkpoint_every=5), tmp_path, resume=True, progress=False)


def test_bad_training_settings_are_refused():
    for bad, message in ((dict(checkpoint_every=0), "checkpoint_every"), (dict(lr=0), "lr"),
                         (dict(samples_per_prompt=1), "samples_per_prompt"), (dict(temperature=0), "temperature"),
                         (dict(lam=-1), "lambda"), (dict(limit=0), "limit")):
        with pytest.raises(ValueError, match=message):
            config(**bad)
