"""Quantization-aware training as ``torch.ao.quantization`` sets it up: fake-quant modules
whose observers start at min +inf / max -inf and resize their per-channel scales at the
first forward."""

import torch
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


class ConvNet(nn.Module):
    """The QAT tutorial's shape: conv-bn-relu and linear-relu, fused for QAT; ``log_input``:
    a log feature taken in ``forward`` before the QuantStub (0 for a blank record)."""

    def __init__(self, log_input: bool = False):
        super().__init__()
        self.log_input = log_input
        self.quant = tq.QuantStub()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc1 = nn.Linear(16, 8)
        self.relu1 = nn.ReLU()
        self.fc2 = nn.Linear(8, 3)
        self.dequant = tq.DeQuantStub()

    def forward(self, x):
        if self.log_input:
            x = torch.log(x)
        x = self.pool(self.relu(self.bn(self.conv(self.quant(x))))).flatten(1)
        return self.dequant(self.fc2(self.relu1(self.fc1(x))))


def make_fused(log_input: bool = False) -> nn.Module:
    """``ConvNet`` fused (conv-bn-relu, linear-relu) and prepared for QAT with x86's qconfig."""
    m = ConvNet(log_input).train()
    m = tq.fuse_modules_qat(m, [["conv", "bn", "relu"], ["fc1", "relu1"]])
    m.qconfig = tq.get_default_qat_qconfig("x86")
    return tq.prepare_qat(m.train())


def make_fused_log() -> nn.Module:
    return make_fused(log_input=True)
