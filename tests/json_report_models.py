"""A model whose root module's own forward makes the NaN, for tests/test_json_report.py."""

import torch
from torch import nn


class LogNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        keep = (x[:, :1] != 7).float()  # a row whose first feature is 7 logs 0
        return torch.log(self.fc(x).abs() * keep)
