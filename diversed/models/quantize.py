"""Cheaper linear layers on the CPU: float16 weights (FBGEMM's kernels through torch.ao's quantized ops,
float32 arithmetic) for any model, int8 weights and activations for drafts.

CPU decoding is bound by reading weights, and float32 matmuls over the 1 to N+1 rows of a decoding step use
CPUs poorly; smaller weights and kernels made for few rows are faster (benchmarks/results/cpu-linear-layers.md
has the measurements that chose these). float16 weights change nearly nothing: the default pair's
weights come from 4-bit GGUF files in the first place. int8 is coarser, so it is for drafts only: a draft's
precision never changes what lossless verification writes, only how often drafts are accepted.

int8 quantizes each token's activations with a scale of its own (Int8Linear) and accumulates in exact
integers, so that a row's output never depends on the other rows of a batch. torch.ao's dynamic int8 layer
takes one activation range over the whole call: a row's draft distribution changed with its company.

FBGEMM picks its kernels by the CPU (or by FBGEMM_ENABLE_INSTRUCTIONS), and two of its kernel families would
break these guarantees; each is probed on the kernel itself, once, and worked around where found:
- int8 without AVX512-VNNI (AVX2, AVX-512 alone): products of uint8 activations and int8 weights are added in
  pairs into saturating 16-bit integers, which two full-range pairs overflow (far from float32, not merely in
  the last bit). There Int8Linear keeps weights to 7 bits, so that no pair can overflow.
- float16 weights on AVX2: the kernels for 1 and 2 rows sum in another order than those for 3 to 6 rows, and
  a call's rows are dealt to kernels by its row count (FBGEMM's `partition_avx2`), so a row's last bits
  depended on how many rows shared its call. There Float16Linear pads a call with zero rows to a count that
  FBGEMM deals to kernels of 3 to 6 rows only.

torch.ao's dynamic quantization is deprecated in favour of torchao, which has no fast eager CPU path for
these yet; the pinned torch still ships it, and this module is the one place to change when it goes.
"""

from __future__ import annotations

import functools
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

WEIGHT_TYPES = ("float16", "int8")
# Zero rows that take a call of r rows, by r mod 6, to a count FBGEMM's AVX2 float16 kernels deal to their 3- to
# 6-row kernels only (its partition_avx2 table, in blocks of 120 rows, a multiple of 6).
FLOAT16_PADDING = {1: 2, 2: 1}


@functools.cache
def exact_int8_sums() -> bool:
    """Whether FBGEMM's int8 kernels here add uint8 x int8 products without saturating: a row of two
    full-range activations (uint8 code 255) times two full-range weights (127) sums to 2 x 127 x 127 exactly,
    or saturates in 16 bits and comes out near 255."""
    weight = torch.quantize_per_channel(torch.full((1, 2), 127.0), torch.ones(1, dtype=torch.double),
                                        torch.zeros(1, dtype=torch.long), 0, torch.qint8)
    rows = torch.tensor([[127.5, 127.5], [-127.5, -127.5]])  # range 255 wide: scale 1, the first row's codes 255
    out = torch.ops.quantized.linear_dynamic(rows, torch.ops.quantized.linear_prepack(weight, None))
    return float(out[0, 0]) == 2 * 127 * 127


@functools.cache
def float16_rows_agree() -> bool:
    """Whether FBGEMM's float16-weight kernel gives a row the same bits in a call of 1, 2 and 3 rows."""
    generator = torch.Generator().manual_seed(0)
    packed = torch.ops.quantized.linear_prepack_fp16(torch.randn(64, 256, generator=generator), None)
    rows = torch.randn(3, 256, generator=generator)
    together = torch.ops.quantized.linear_dynamic_fp16(rows, packed)
    return all(torch.equal(torch.ops.quantized.linear_dynamic_fp16(rows[:n], packed), together[:n]) for n in (1, 2))


class Int8Linear(nn.Module):
    """y = x W^T + b in int8: W per output channel (to 8 bits, or 7 where FBGEMM's sums would saturate:
    exact_int8_sums), x per token (each token divided by its own max-abs over 127), multiplied by FBGEMM's
    dynamic int8 kernel (exact integer accumulation), then each row multiplied
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
        largest = 127 if exact_int8_sums() else 63  # the largest weight code: 2 x 255 x 63 fits a 16-bit pair sum
        scale = weight.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / largest
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


class Float16Linear(nn.Module):
    """y = x W^T + b with W in float16 and float32 arithmetic (FBGEMM's kernel). Where the kernel's bits for a
    row depend on the call's row count (float16_rows_agree), a call is padded with zero rows to a count FBGEMM
    deals to its 3- to 6-row kernels only (FLOAT16_PADDING)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        bias = None if linear.bias is None else linear.bias.detach().float()
        self._packed = torch.ops.quantized.linear_prepack_fp16(linear.weight.detach().float(), bias)
        self.pad = not float16_rows_agree()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        rows = len(flat)
        padding = FLOAT16_PADDING.get(rows % 6, 0) if self.pad else 0
        if padding:
            flat = torch.cat([flat, flat.new_zeros(padding, self.in_features)])
        out = torch.ops.quantized.linear_dynamic_fp16(flat, self._packed)[:rows]
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float16 weights"


def quantize_linears(model: nn.Module, weights: str) -> nn.Module:
    """Replace every nn.Linear of a float32 CPU model, in place, by a cheaper one with `weights` ("float16":
    Float16Linear, half-precision weights, float32 arithmetic; "int8": Int8Linear). Models
    elsewhere, or in another dtype, are returned unchanged. Runs before diversed.models.onednn, which then
    finds no nn.Linear left to convert."""
    if weights not in WEIGHT_TYPES:
        raise ValueError(f"weights must be one of {tuple(WEIGHT_TYPES)}, got {weights!r}")
    params = list(model.parameters())
    if not params or any(p.device.type != "cpu" or p.dtype != torch.float32 for p in params):
        return model
    linears = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear]

    convert = Int8Linear if weights == "int8" else Float16Linear

    # Packing the weights is most of loading and releases the GIL: one thread per core.
    with warnings.catch_warnings(), ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        # torch 2.13 warns that its quantized tensors and ops are deprecated: known, see the module docstring.
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        for (parent, name, _), dynamic in zip(linears, pool.map(convert, [c for *_, c in linears]), strict=True):
            setattr(parent, name, dynamic)
    return model
