"""The weight head: its starting weight, its input checks, saving and loading (its training: test_train.py)."""

import pytest
import torch

from diversed.head.model import EnsembleHead, HeadConfig
from diversed.head.names import DEFAULT_HEAD, PRETRAINED, PRETRAINED_HEADS, head_folder
from diversed.models.default_pair import DEFAULT_DRAFT, DEFAULT_TARGET


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
    assert head.config.training["task"] == name
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
