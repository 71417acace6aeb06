"""The weight head: its starting weight, its input checks, saving and loading (its training: test_train.py)."""

import pytest
import torch

from diversed.head.model import EnsembleHead, HeadConfig


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
