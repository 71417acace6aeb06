"""Cheaper linear layers on the CPU through torch.ao dynamic quantization: float16 or int8 weights.

CPU decoding is bound by reading weights, and float32 matmuls over the 1 to N+1 rows of a decoding step use
these CPUs poorly. FBGEMM's dynamic kernels read smaller weights and handle few rows well. Measured on this
project's CPU machines (2 AVX2 cores, torch 2.13) on the default pair, 222 tokens in the cache, medians of 8:

| linear layers | target step | target pass over 6 tokens | over 21 tokens | draft step |
|---|---|---|---|---|
| float32 oneDNN (diversed.models.onednn) | 347 ms | 667 ms | 1,064 ms | 105 ms |
| float16 weights, float32 arithmetic | 166-189 ms | 237-256 ms | 667-693 ms | 77 ms |
| int8 weights per output channel, int8 activations per call | - | - | - | 55-63 ms |

Earlier candidates for the draft, one step (200-token prompt): float32 nn.Linear 165 ms; torchao 0.18
Int8WeightOnlyConfig / Int8DynamicActivationInt8WeightConfig (eager) 539 / 429 ms; aten._weight_int8pack_mm
314 ms.

float16 weights change nearly nothing: over 925 teacher-forced positions of HumanEval prompts and solutions,
both models' float16-weight argmax equals float32's at every position, with a mean total variation of
0.0001 (the default pair's weights come from 4-bit GGUF files in the first place). int8 is coarser: the
int8 draft's next-token distribution overlaps the float32 draft's by 0.75 on average (1 - total variation).
That is why int8 is for drafts only: a draft's precision never changes what lossless verification writes,
only how often drafts are accepted.

torch.ao's dynamic quantization is deprecated in favour of torchao, which has no fast eager CPU path for
these yet; the pinned torch still ships it, and this module is the one place to change when it goes.
"""

from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn
from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

WEIGHT_TYPES = {"float16": torch.float16, "int8": torch.qint8}


def quantize_linears(model: nn.Module, weights: str) -> nn.Module:
    """Replace every nn.Linear of a float32 CPU model, in place, by a dynamic one with `weights` ("float16":
    half-precision weights, float32 arithmetic; "int8": int8 weights per output channel, activations
    quantized per call). Models elsewhere, or in another dtype, are returned unchanged. Runs before
    diversed.models.onednn, which then finds no nn.Linear left to convert."""
    if weights not in WEIGHT_TYPES:
        raise ValueError(f"weights must be one of {tuple(WEIGHT_TYPES)}, got {weights!r}")
    params = list(model.parameters())
    if not params or any(p.device.type != "cpu" or p.dtype != torch.float32 for p in params):
        return model
    qconfig = (torch.ao.quantization.per_channel_dynamic_qconfig if weights == "int8"
               else torch.ao.quantization.float16_dynamic_qconfig)
    linears = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear]

    def convert(linear: nn.Linear) -> nn.Module:
        linear.qconfig = qconfig
        return DynamicLinear.from_float(linear)

    # Packing the weights is most of loading (44 s for the default target in float16 on one thread) and
    # releases the GIL: one thread per core.
    with warnings.catch_warnings(), ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        # torch 2.13 warns that torch.ao quantization is deprecated: known, see the module docstring.
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        for (parent, name, _), dynamic in zip(linears, pool.map(convert, [c for *_, c in linears]), strict=True):
            setattr(parent, name, dynamic)
    return model
