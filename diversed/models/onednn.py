"""oneDNN linear layers: the matmuls of CPU decoding at close to memory speed.

Decoding multiplies 1 to N+1 rows by every weight matrix. On the CPUs this project measured (torch with MKL),
nn.Linear falls well short of the memory bandwidth for one row and further for a few rows; oneDNN's kernels do
not (the measurements: benchmarks/results/cpu-linear-layers.md).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class OneDNNLinear(nn.Module):
    """y = x W^T + b with W kept in oneDNN's layout (float32, CPU). Inference only."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight.detach().float().to_mkldnn()
        self.bias = None if linear.bias is None else linear.bias.detach().float().to_mkldnn()

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features).contiguous().to_mkldnn()
        y = torch._C._nn.mkldnn_linear(rows, self.weight, self.bias).to_dense()
        return y.reshape(*x.shape[:-1], self.out_features)


def use_onednn_linears(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear of a float32 CPU model by a OneDNNLinear, in place (the dense weights are
    freed, so memory does not grow). The outputs match nn.Linear's up to float rounding (~1e-5)."""
    if not torch.backends.mkldnn.is_available():
        return model
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu":
                setattr(parent, name, OneDNNLinear(child))
    return model
