"""Dynamic float16 and int8 linear layers: cheaper CPU models that leave lossless verification exact, on
every kind of x86 CPU: FBGEMM's kernels for the other kinds are forced and tested here too."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diversed.cpu import cpu_flags
from diversed.decoding.engine import decode
from diversed.models.quantize import Float16Linear, Int8Linear, exact_int8_sums, float16_rows_agree, quantize_linears
from diversed.request import Sampling, Verification

from tiny import perturbed, tiny_model

FORCED = os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS")  # FBGEMM's kernels chosen by hand, not by the CPU
AVX512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl"}  # what FBGEMM needs for its AVX-512 kernels


def _is(weights: str, layer: torch.nn.Module) -> bool:
    return isinstance(layer, Int8Linear if weights == "int8" else Float16Linear)


@pytest.mark.parametrize(("weights", "max_tv"), [("float16", 1e-3), ("int8", 0.1)])
def test_every_linear_layer_is_replaced_and_the_distributions_stay_close(weights, max_tv):
    model = tiny_model(0, layers=2)
    ids = torch.tensor([[3, 5, 7, 11, 13]])
    with torch.no_grad():
        before = model(ids).logits
        quantize_linears(model, weights)
        after = model(ids).logits
    assert not [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert _is(weights, model.lm_head)
    assert torch.corrcoef(torch.stack([before.flatten(), after.flatten()]))[0, 1] > 0.99
    tv = 0.5 * (after.softmax(-1) - before.softmax(-1)).abs().sum(-1)
    assert tv.max() < max_tv  # float16 weights: float32's distributions up to the weights' rounding


@pytest.mark.parametrize(("inputs", "outputs"), [(64, 40), (896, 128), (4864, 896)])
def test_an_int8_layer_gives_each_token_what_it_gives_it_alone(inputs, outputs):
    """Per-token activation scales and integer accumulation: a token's output is bit for bit the same
    whatever else the call holds and wherever the token sits in it, unlike a scale shared over the batch.
    The real draft's shapes too (Qwen2.5-0.5B's k/v and down projections): FBGEMM's kernels for other row
    counts parted there in the last bit while the activation scale was not exactly 1."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(inputs, outputs)
    layer = Int8Linear(linear)
    x = torch.randn(24, inputs) * torch.rand(24, 1) * 3
    x[3] *= 50  # a loud neighbour would set a shared scale
    together = layer(x)
    assert all(torch.equal(layer(x[i:i + 1])[0], together[i]) for i in range(24))
    assert all(torch.equal(layer(x[i:i + 5]), together[i:i + 5]) for i in range(20))
    assert torch.equal(layer(x.view(2, 12, inputs)).view(24, outputs), together)
    assert torch.allclose(together, linear(x), rtol=0.05, atol=0.05 * float(linear(x).abs().max()))


def test_a_float16_layer_gives_each_row_what_it_gives_it_alone():
    """In calls of every row count up to 14 and past FBGEMM's 120-row blocks; where the layer pads (FBGEMM's
    AVX2 kernels), the same calls unpadded part from it: the padding is what holds it."""
    torch.manual_seed(0)
    layer = Float16Linear(torch.nn.Linear(256, 64))
    x = torch.randn(130, 256)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(130)])
    counts = (*range(2, 15), 121, 122, 130)
    assert all(torch.equal(layer(x[:n]), alone[:n]) for n in counts)
    assert torch.equal(layer(x[:12].view(3, 4, 256)), alone[:12].view(3, 4, 64))
    if layer.pad:
        layer.pad = False
        assert not all(torch.equal(layer(x[:n]), alone[:n]) for n in (1, *counts))


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
    plain = decode(target, prompts, verification=Verification("plain"), sampling=Sampling(0), max_new_tokens=16)
    fast = decode(target, prompts, draft=draft, verification=Verification("exact"), sampling=Sampling(0),
                  max_new_tokens=16, draft_length=4)
    assert fast.tokens == plain.tokens
    assert sum(s.accepted for s in fast.stats) > 0


def test_greedy_exact_on_a_float16_weight_target_writes_its_own_tokens():
    target = quantize_linears(tiny_model(0, layers=3), "float16")
    draft = perturbed(tiny_model(0, layers=3), 0.05, 1)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    plain = decode(target, prompts, verification=Verification("plain"), sampling=Sampling(0), max_new_tokens=16)
    fast = decode(target, prompts, draft=draft, verification=Verification("exact"), sampling=Sampling(0),
                  max_new_tokens=16, draft_length=3)
    assert fast.tokens == plain.tokens


@pytest.mark.skipif(FORCED is not None, reason="FBGEMM's kernels are forced: the CPU's flags do not choose them")
def test_the_probes_find_what_the_cpu_has():
    """The README's statement of what holds where: int8 sums exact with AVX512-VNNI, float16 rows alike in
    any call with AVX-512; the layers probe the kernels, which FBGEMM picks by these flags."""
    flags = cpu_flags()
    assert exact_int8_sums() == (AVX512 | {"avx512_vnni"} <= flags)
    assert float16_rows_agree() == (AVX512 <= flags)


@pytest.mark.skipif(FORCED != "AVX2", reason="needs FBGEMM's AVX2 kernels: the test below forces them")
def test_the_probes_find_the_avx2_kernels_wanting():
    assert not exact_int8_sums() and not float16_rows_agree()


@pytest.mark.skipif(FORCED != "AVX512" or not AVX512 <= cpu_flags(),
                    reason="needs FBGEMM's AVX-512 kernels without VNNI: the test below forces them where it can")
def test_the_probes_find_the_avx512_kernels_without_vnni():
    assert not exact_int8_sums() and float16_rows_agree()


# An AVX2-only CPU runs ATen's, oneDNN's and MKL's AVX2 kernels too.
OTHER_KERNELS = {"AVX2": {"FBGEMM_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
                          "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
                 "AVX512": {"FBGEMM_ENABLE_INSTRUCTIONS": "AVX512"}}


@pytest.mark.skipif(FORCED is not None, reason="the child of this test: its kernels are forced already")
@pytest.mark.parametrize("kernels", list(OTHER_KERNELS))
def test_the_guarantees_hold_with_fbgemm_s_other_kernels(kernels):
    """CI lands on x86 CPUs of several kinds, all with AVX2 at least: on whichever runs the suite, this file's
    tests and the row-by-row test of the transformers backend run again in a child with FBGEMM forced to its
    AVX2 kernels (and torch's others to theirs) and to its AVX-512 kernels without VNNI."""
    if kernels == "AVX512" and not AVX512 <= cpu_flags():
        pytest.skip("this CPU has no AVX-512: FBGEMM cannot run its AVX-512 kernels here")
    tests = Path(__file__).parent
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests / "test_quantize.py"),
         str(tests / "test_backends.py") + "::test_on_a_cpu_a_row_computes_the_same_bits_alone_and_beside_holes"],
        env={**os.environ, **OTHER_KERNELS[kernels]}, capture_output=True, text=True, cwd=tests.parent, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout
