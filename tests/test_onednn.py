"""oneDNN linear layers give nn.Linear's numbers, and the decoding loop stays exact with them."""

import torch

from diversed.decoding.engine import decode
from diversed.models.onednn import OneDNNLinear, use_onednn_linears
from diversed.request import Sampling, Verification

from tiny import perturbed, tiny_model


def test_onednn_linear_matches_nn_linear_for_any_number_of_rows():
    for bias in (True, False):
        linear = torch.nn.Linear(48, 80, bias=bias)
        fast = OneDNNLinear(linear)
        for shape in ((1, 48), (6, 48), (2, 3, 48), (4, 1, 48)):
            x = torch.randn(shape)
            torch.testing.assert_close(fast(x), linear(x), atol=1e-5, rtol=1e-5)


def test_models_with_onednn_decode_like_plain_ones():
    target = tiny_model(0, layers=3)
    draft = perturbed(target, 0.05, 1)
    prompts = [[1, 2, 3, 4], [5, 6]]
    plain = decode(target, prompts, verification=Verification("plain"), sampling=Sampling(0), max_new_tokens=16)
    use_onednn_linears(target)
    use_onednn_linears(draft)
    assert isinstance(target.lm_head, OneDNNLinear) and isinstance(target.model.layers[0].mlp.up_proj, OneDNNLinear)
    fast = decode(target, prompts, draft=draft, verification=Verification("exact"), sampling=Sampling(0),
                  max_new_tokens=16)
    assert fast.tokens == plain.tokens
