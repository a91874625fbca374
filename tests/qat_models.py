"""Quantization-aware training as ``torch.ao.quantization`` sets it up: fake-quant modules
whose observers start at min +inf / max -inf and resize their per-channel scales at the
first forward."""

import torch.ao.quantization as tq
from torch import nn


class Net(nn.Module):
    """A small classifier between a QuantStub and a DeQuantStub."""

    def __init__(self):
        super().__init__()
        self.quant = tq.QuantStub()
        self.fc1 = nn.Linear(16, 32)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(32, 4)
        self.dequant = tq.DeQuantStub()

    def forward(self, x):
        return self.dequant(self.fc2(self.relu(self.fc1(self.quant(x)))))


def make_qat() -> nn.Module:
    """The model prepared for QAT (fbgemm's default qconfig: per-channel weight fake-quant)."""
    m = Net()
    m.train()
    m.qconfig = tq.get_default_qat_qconfig("fbgemm")
    return tq.prepare_qat(m)
