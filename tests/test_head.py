"""The heads: their starting values, their input checks, saving and loading, the lenience heads' bound and dial,
and their use in verification, copied drafts included (their training: test_train.py)."""

import json

import pytest
import torch

from diversed.decoding.drafters import Proposal
from diversed.decoding.policy import Groups, Policy
from diversed.decoding.profile import PhaseClock
from diversed.head.model import FEATURES, EnsembleHead, HeadConfig, LenienceHead, build, token_features
from diversed.head.names import DEFAULT_HEAD, PRETRAINED, PRETRAINED_HEADS, head_folder
from diversed.models.default_pair import DEFAULT_DRAFT, DEFAULT_TARGET
from diversed.request import Sampling, Verification
from diversed.verify import verify

LENIENCE_KINDS = ("lenience", "lenience-target")
B, N, V = 6, 3, 10


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
    torch.manual_seed(0)
    for parameter in head.parameters():  # every layer, the last one too (it starts at zero)
        torch.nn.init.normal_(parameter)
    head.save(tmp_path)
    loaded = EnsembleHead.load(tmp_path, draft_hidden=8, target_hidden=12, draft_model="d")
    assert head.state_dict().keys() == loaded.state_dict().keys()
    assert all(torch.equal(value, loaded.state_dict()[key]) for key, value in head.state_dict().items())
    x, y = torch.randn(4, 8), torch.randn(4, 12)
    assert torch.equal(head(x, y), loaded(x, y))
    assert not torch.allclose(loaded(x, y), EnsembleHead(head.config)(x, y))  # not the untrained head's w
    with pytest.raises(ValueError, match="target hidden size"):
        EnsembleHead.load(tmp_path, target_hidden=1536)
    with pytest.raises(ValueError, match="draft model"):
        EnsembleHead.load(tmp_path, draft_model="other")
    (tmp_path / "head.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="corrupt head weights"):
        EnsembleHead.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="head.json"):
        EnsembleHead.load(tmp_path / "missing")


@pytest.mark.parametrize("name", PRETRAINED_HEADS)
def test_shipped_heads_load_by_name_for_the_default_pair_with_their_account(name):
    head = EnsembleHead.load(name, draft_model=DEFAULT_DRAFT.name, target_model=DEFAULT_TARGET.name)
    task = head.config.training["task"]
    assert name == task or name.startswith(task + "-")  # a shipped head is named by its task
    assert (head_folder(name) / "README.md").is_file()  # how it was trained and what it scored


def test_head_folder_resolves_names_folders_and_the_default_and_names_what_is_missing(tmp_path):
    assert head_folder(None) == PRETRAINED / DEFAULT_HEAD and head_folder("gsm8k") == PRETRAINED / "gsm8k"
    EnsembleHead(HeadConfig(4, 4)).save(tmp_path / "mine")
    assert head_folder(tmp_path / "mine") == tmp_path / "mine" and head_folder(str(tmp_path / "mine"))
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "head.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="head.safetensors is missing.*gsm8k"):
        head_folder(tmp_path / "half")
    with pytest.raises(FileNotFoundError, match="no head checkpoint in gsm9k"):
        head_folder("gsm9k")


def randomised(head: EnsembleHead, scale: float = 1.0) -> EnsembleHead:
    """The head with every parameter drawn at random (the last layer starts at zero), so its outputs vary."""
    torch.manual_seed(0)
    for parameter in head.parameters():
        torch.nn.init.normal_(parameter, std=scale)
    return head


def block(seed: int = 0, copied: bool = False) -> tuple[torch.Tensor, ...]:
    """A verifier's view of B rows of N drafts: drafts, q [B, N, V] (one-hot where copied), p [B, N + 1, V] and
    the target's hidden states [B, N + 1, 12]."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(2 * torch.randn(B, N + 1, V, generator=g), -1)
    q = torch.softmax(2 * torch.randn(B, N, V, generator=g), -1)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, N)
    if copied:
        q = torch.nn.functional.one_hot(drafts, V).float()
    return drafts, q, p, torch.randn(B, N + 1, 12, generator=g)


@pytest.mark.parametrize("kind", LENIENCE_KINDS)
def test_a_lenience_head_starts_at_its_initial_lenience_and_stays_below_its_maximum(kind):
    drafts, q, p, h_target = block()
    for initial in (0.3, 0.9):
        head = build(HeadConfig(8, 12, kind=kind, max_lenience=0.95, initial_lenience=initial))
        assert isinstance(head, LenienceHead)
        torch.testing.assert_close(head.lenience(drafts, q, p[:, :N], h_target[:, :N]), torch.full((B, N), initial))
    for architecture in ("linear", "mlp"):  # weights far from zero push the logits to either end
        head = randomised(build(HeadConfig(8, 12, architecture, kind=kind, max_lenience=0.95)), scale=10.0)
        lenience = head.lenience(drafts, q, p[:, :N], h_target[:, :N])
        assert lenience.shape == (B, N) and lenience.dtype == torch.float32
        # At most the maximum (a sigmoid saturates to 1 in float32), so the overshoot stays within 1 / (1 - 0.95).
        assert bool(((lenience >= 0) & (lenience <= 0.95)).all()) and lenience.std() > 0.1


def test_a_lenience_head_reads_the_features_of_its_kind_only():
    drafts, q, p, h_target = block()
    features = token_features(drafts, q, p[:, :N])
    assert features.shape == (B, N, len(FEATURES))
    x = drafts.unsqueeze(-1)
    torch.testing.assert_close(features[..., 0], p[:, :N].gather(-1, x).squeeze(-1))
    torch.testing.assert_close(features[..., 3], q.gather(-1, x).squeeze(-1))
    other_q = torch.softmax(torch.randn(B, N, V), -1)
    target_only = randomised(build(HeadConfig(8, 12, kind="lenience-target")))
    both = randomised(build(HeadConfig(8, 12, kind="lenience")))
    assert torch.equal(target_only.lenience(drafts, q, p[:, :N], h_target[:, :N]),
                       target_only.lenience(drafts, other_q, p[:, :N], h_target[:, :N]))
    assert not torch.allclose(both.lenience(drafts, q, p[:, :N], h_target[:, :N]),
                              both.lenience(drafts, other_q, p[:, :N], h_target[:, :N]))
    with pytest.raises(ValueError, match="hidden sizes"):
        both.lenience(drafts, q, p[:, :N], torch.randn(B, N, 13))


@pytest.mark.parametrize("shift", [0.0, 1.5, -1.5])
def test_the_target_only_head_verifies_copied_drafts_as_lossy_at_its_lenience(shift):
    """Point-mass drafts (q one-hot) and no draft hidden state: the head's L, shifted by the verification's dial, is
    what "lossy" verifies with, decision for decision under one seed."""
    drafts, q, p, h_target = block(copied=True)
    head = randomised(build(HeadConfig(8, 12, kind="lenience-target")))

    def policy() -> Policy:
        return Policy(Verification("diversed", shift=shift or None), Sampling(1.0), torch.Generator().manual_seed(5),
                      head)

    mine, same = policy(), policy()
    with torch.no_grad():
        proposal = Proposal(drafts, torch.full((B,), N), q, None, 0, ["lookup"] * B)
        out = Groups([mine] * B).verify(proposal, p, h_target, PhaseClock(torch.device("cpu")))
        lenience = head.lenience(drafts, q, p[:, :N], h_target[:, :N], shift)
    expected = verify("lossy", drafts, q, p, lenience=lenience, generator=Groups([same] * B).streams[id(same)][1])
    assert 0 < int(out.num_accepted.sum()) < B * N  # not vacuous
    assert torch.equal(out.num_accepted, expected.num_accepted) and torch.equal(out.next_token, expected.next_token)
    torch.testing.assert_close(out.accept_prob, expected.accept_prob)
    p_x = p[:, :N].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out.accept_prob, (p_x / (1 - lenience)).clamp(max=1.0))  # q(x) = 1


def test_the_dial_makes_a_lenience_head_stricter_with_plus_and_never_crosses_its_bound():
    drafts, q, p, h_target = block()
    head = randomised(build(HeadConfig(8, 12, kind="lenience", max_lenience=0.9)))
    at = {k: head.lenience(drafts, q, p[:, :N], h_target[:, :N], k) for k in (-50.0, -1.0, 0.0, 1.0)}
    assert bool((at[1.0] < at[0.0]).all() and (at[0.0] < at[-1.0]).all())
    share = at[0.0] / 0.9
    torch.testing.assert_close(at[1.0], 0.9 * torch.sigmoid(torch.logit(share) - 1.0))
    assert bool((at[-50.0] <= 0.9).all())  # however lenient the dial, the overshoot stays within 1 / (1 - 0.9)


@pytest.mark.parametrize("kind", LENIENCE_KINDS)
def test_a_lenience_head_round_trips_as_safetensors_and_json_with_its_kind(kind, tmp_path):
    head = randomised(build(HeadConfig(8, 12, "mlp", draft_model="d", target_model="t", kind=kind,
                                       max_lenience=0.97, initial_lenience=0.2)))
    head.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head.json", "head.safetensors"]
    saved = json.loads((tmp_path / "head.json").read_text())
    assert (saved["kind"], saved["max_lenience"], saved["initial_lenience"]) == (kind, 0.97, 0.2)
    loaded = EnsembleHead.load(tmp_path, draft_hidden=8, target_hidden=12, draft_model="d", target_model="t")
    assert type(loaded) is LenienceHead and loaded.config == head.config
    drafts, q, p, h_target = block()
    assert torch.equal(loaded.lenience(drafts, q, p[:, :N], h_target[:, :N]),
                       head.lenience(drafts, q, p[:, :N], h_target[:, :N]))
    with pytest.raises(ValueError, match="target model"):
        EnsembleHead.load(tmp_path, target_model="other")
    if kind == "lenience-target":  # it reads nothing of the draft model: any drafter's, or none
        EnsembleHead.load(tmp_path, draft_hidden=896, draft_model="other")
    else:
        with pytest.raises(ValueError, match="draft model"):
            EnsembleHead.load(tmp_path, draft_model="other")


def test_a_head_saved_before_kinds_loads_as_the_mixture_head(tmp_path):
    EnsembleHead(HeadConfig(8, 12)).save(tmp_path)
    config = json.loads((tmp_path / "head.json").read_text())
    for name in ("kind", "max_lenience", "initial_lenience"):
        del config[name]
    (tmp_path / "head.json").write_text(json.dumps(config))
    loaded = EnsembleHead.load(tmp_path)
    assert type(loaded) is EnsembleHead and loaded.config.kind == "mixture"


@pytest.mark.parametrize("bad, match", [({"kind": "bounded"}, "kind"), ({"max_lenience": 1.0}, "max lenience"),
                                        ({"initial_lenience": 0.995}, "initial lenience")])
def test_bad_lenience_settings_are_refused_naming_them(bad, match):
    with pytest.raises(ValueError, match=match):
        HeadConfig(8, 12, **{"kind": "lenience", **bad})

