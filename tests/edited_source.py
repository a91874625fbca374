"""The model module the edited-code tests write, train, edit and replay (a Norm without eps:
its 0/0 on a constant row is the planted event)."""

MODEL = '''import torch
from torch import nn


class Norm(nn.Module):
    def forward(self, x):
        mean = x.mean(dim=1, keepdim=True)
        std = x.std(dim=1, keepdim=True)
        return (x - mean) / std


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = Norm()
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(self.norm(x))))


def make_model():
    torch.manual_seed(0)
    return Net()
'''
