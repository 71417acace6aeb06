"""The dynamic-int8 draft: a cheaper draft that leaves lossless verification exact."""

import torch
from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear

from diversed.decoding.engine import decode
from diversed.decoding.method import Method
from diversed.decoding.sampling import Sampling
from diversed.models.int8 import quantize_linears_int8

from tiny import perturbed, tiny_model


def test_every_linear_layer_becomes_int8_and_the_logits_stay_close():
    model = tiny_model(0, layers=2)
    ids = torch.tensor([[3, 5, 7, 11, 13]])
    with torch.no_grad():
        before = model(ids).logits
        quantize_linears_int8(model)
        after = model(ids).logits
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert isinstance(model.lm_head, DynamicInt8Linear) and not linears
    assert torch.corrcoef(torch.stack([before.flatten(), after.flatten()]))[0, 1] > 0.99


def test_a_bfloat16_model_is_left_alone():
    model = tiny_model(0).to(torch.bfloat16)
    quantize_linears_int8(model)
    assert type(model.lm_head) is torch.nn.Linear


def test_greedy_exact_with_an_int8_draft_writes_the_targets_tokens():
    target = tiny_model(0, layers=3)
    draft = quantize_linears_int8(perturbed(target, 0.05, 1))
    prompts = [[1, 2, 3, 4], [5, 6]]
    plain = decode(target, prompts, method=Method("auto"), sampling=Sampling(0), max_new_tokens=16)
    fast = decode(target, prompts, draft=draft, method=Method("exact"), sampling=Sampling(0), max_new_tokens=16,
                  draft_length=4)
    assert fast.tokens == plain.tokens
    assert sum(s.accepted for s in fast.stats) > 0
