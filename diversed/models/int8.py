"""A cheaper draft on the CPU: its linear layers in dynamic int8 (int8 weights, activations quantized per call).

The draft's precision never changes what lossless verification writes, only how often drafts are accepted,
so the draft can be made cheaper than the target may be. Chosen by measurement on this project's CPU
machines (2 AVX2 cores, torch 2.13; the 0.5B draft of the default pair, one decoding step after a
200-token prompt, medians of 10):

| linear layers | draft step |
|---|---|
| float32 nn.Linear | 165 ms |
| float32 oneDNN (diversed.models.onednn) | 105 ms |
| torchao 0.18 Int8WeightOnlyConfig / Int8DynamicActivationInt8WeightConfig (eager) | 539 / 429 ms |
| aten._weight_int8pack_mm (per-channel int8 weights) | 314 ms |
| torch.ao quantize_dynamic, qint8 (FBGEMM kernels) | 55-58 ms |

The price: on a HumanEval chat prompt the int8 draft's next-token distribution overlaps the float32
draft's by 0.75 on average (1 - total variation; 0.71 with one weight scale per tensor instead of per
output channel). That costs acceptance, never correctness; benchmarks/README.md has the net effect.

torch.ao's dynamic quantization is deprecated in favour of torchao, but torchao has no fast eager CPU
path for it yet; the pinned torch still ships it, and this module is the one place to change when it goes.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn


def quantize_linears_int8(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear of a float32 CPU model by a dynamic-int8 one (weights per output channel,
    activations per call), in place. Models elsewhere, or in another dtype, are returned unchanged. Runs
    before diversed.models.onednn, which then finds no nn.Linear left to convert."""
    params = list(model.parameters())
    if not params or any(p.device.type != "cpu" or p.dtype != torch.float32 for p in params):
        return model
    with warnings.catch_warnings():
        # torch 2.13 warns that torch.ao quantization is deprecated: known, see the module docstring.
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.ao.quantization.quantize_dynamic(
            model, {nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True)
    return model
