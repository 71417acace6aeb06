"""Dynamic float16 and int8 linear layers: cheaper CPU models that leave lossless verification exact."""

import pytest
import torch
from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

from diversed.decoding.engine import decode
from diversed.decoding.method import Method
from diversed.decoding.sampling import Sampling
from diversed.models.quantize import quantize_linears

from tiny import perturbed, tiny_model


@pytest.mark.parametrize(("weights", "stored", "max_tv"),
                         [("float16", torch.float16, 1e-3), ("int8", torch.qint8, 0.1)])
def test_every_linear_layer_is_replaced_and_the_distributions_stay_close(weights, stored, max_tv):
    model = tiny_model(0, layers=2)
    ids = torch.tensor([[3, 5, 7, 11, 13]])
    with torch.no_grad():
        before = model(ids).logits
        quantize_linears(model, weights)
        after = model(ids).logits
    assert not [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert isinstance(model.lm_head, DynamicLinear) and model.lm_head._packed_params.dtype == stored
    assert torch.corrcoef(torch.stack([before.flatten(), after.flatten()]))[0, 1] > 0.99
    tv = 0.5 * (after.softmax(-1) - before.softmax(-1)).abs().sum(-1)
    assert tv.max() < max_tv  # float16 weights: float32's distributions up to the weights' rounding


def test_a_bfloat16_model_is_left_alone_and_unknown_weights_are_refused():
    model = tiny_model(0).to(torch.bfloat16)
    quantize_linears(model, "int8")
    assert type(model.lm_head) is torch.nn.Linear
    with pytest.raises(ValueError, match="weights must be one of"):
        quantize_linears(tiny_model(0), "int4")


@pytest.mark.parametrize("weights", ["float16", "int8"])
def test_greedy_exact_with_a_quantized_draft_writes_the_targets_tokens(weights):
    target = tiny_model(0, layers=3)
    draft = quantize_linears(perturbed(target, 0.05, 1), weights)
    prompts = [[1, 2, 3, 4], [5, 6]]
    plain = decode(target, prompts, method=Method("auto"), sampling=Sampling(0), max_new_tokens=16)
    fast = decode(target, prompts, draft=draft, method=Method("exact"), sampling=Sampling(0), max_new_tokens=16,
                  draft_length=4)
    assert fast.tokens == plain.tokens
    assert sum(s.accepted for s in fast.stats) > 0


def test_greedy_exact_on_a_float16_weight_target_writes_its_own_tokens():
    target = quantize_linears(tiny_model(0, layers=3), "float16")
    draft = perturbed(tiny_model(0, layers=3), 0.05, 1)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    plain = decode(target, prompts, method=Method("auto"), sampling=Sampling(0), max_new_tokens=16)
    fast = decode(target, prompts, draft=draft, method=Method("exact"), sampling=Sampling(0), max_new_tokens=16,
                  draft_length=3)
    assert fast.tokens == plain.tokens
