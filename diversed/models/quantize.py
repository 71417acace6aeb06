"""Cheaper linear layers on the CPU: float16 weights (torch.ao's dynamic FBGEMM kernels, float32 arithmetic)
for any model, int8 weights and activations for drafts.

CPU decoding is bound by reading weights, and float32 matmuls over the 1 to N+1 rows of a decoding step use
CPUs poorly; smaller weights and kernels made for few rows are faster (benchmarks/README.md, "CPU linear
layers", has the measurements that chose these). float16 weights change nearly nothing: the default pair's
weights come from 4-bit GGUF files in the first place. int8 is coarser, so it is for drafts only: a draft's
precision never changes what lossless verification writes, only how often drafts are accepted.

int8 quantizes each token's activations with a scale of its own (Int8Linear) and accumulates in exact
integers, so that a row's output never depends on the other rows of a batch. torch.ao's dynamic int8 layer
takes one activation range over the whole call: a row's draft distribution changed with its company.

torch.ao's dynamic quantization is deprecated in favour of torchao, which has no fast eager CPU path for
these yet; the pinned torch still ships it, and this module is the one place to change when it goes.
"""

from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn
from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

WEIGHT_TYPES = ("float16", "int8")


class Int8Linear(nn.Module):
    """y = x W^T + b in int8: W per output channel, x per token (each token divided by its own max-abs over
    127), multiplied by FBGEMM's dynamic int8 kernel (exact integer accumulation), then each row multiplied
    back by its token's scale. FBGEMM picks one activation range for a whole call, from its min and max, which
    would make a row depend on its company: an anchor row holding +127.5 and -127.5 fixes that range for every
    call (the anchor's output is dropped). Its width, 255, makes the activation scale exactly 1: FBGEMM's
    kernels for different row counts and positions order the float rescaling of the integer sums differently,
    which parts in the last bit unless one factor is 1. So each token's output depends on that token alone,
    however many rows a call holds and wherever the token sits among them."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        scale = weight.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
        quantized = torch.quantize_per_channel(weight, scale.double(), torch.zeros(len(scale), dtype=torch.long),
                                               0, torch.qint8)
        self._packed = torch.ops.quantized.linear_prepack(quantized, None)  # the bias is added after rescaling
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())
        anchor = torch.zeros(1, self.in_features)
        anchor[0, 0], anchor[0, -1] = 127.5, -127.5
        self.register_buffer("anchor", anchor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        scale = flat.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127
        rows = torch.cat([flat / scale, self.anchor])
        out = torch.ops.quantized.linear_dynamic(rows, self._packed)[:-1] * scale
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per token"


def quantize_linears(model: nn.Module, weights: str) -> nn.Module:
    """Replace every nn.Linear of a float32 CPU model, in place, by a cheaper one with `weights` ("float16":
    torch.ao's dynamic layer, half-precision weights, float32 arithmetic; "int8": Int8Linear). Models
    elsewhere, or in another dtype, are returned unchanged. Runs before diversed.models.onednn, which then
    finds no nn.Linear left to convert."""
    if weights not in WEIGHT_TYPES:
        raise ValueError(f"weights must be one of {tuple(WEIGHT_TYPES)}, got {weights!r}")
    params = list(model.parameters())
    if not params or any(p.device.type != "cpu" or p.dtype != torch.float32 for p in params):
        return model
    linears = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear]

    def convert(linear: nn.Linear) -> nn.Module:
        if weights == "int8":
            return Int8Linear(linear)
        linear.qconfig = torch.ao.quantization.float16_dynamic_qconfig
        return DynamicLinear.from_float(linear)

    # Packing the weights is most of loading and releases the GIL: one thread per core.
    with warnings.catch_warnings(), ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        # torch 2.13 warns that torch.ao quantization is deprecated: known, see the module docstring.
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        for (parent, name, _), dynamic in zip(linears, pool.map(convert, [c for *_, c in linears]), strict=True):
            setattr(parent, name, dynamic)
    return model
