"""Models built from config objects, as research code writes them (``test_config_args``):
nanoGPT's ``GPT(config)`` keeping ``self.config`` (a frozen dataclass nesting another, with an
enum, a path, a dtype and timm-style callables in it), ``Net(args)`` keeping an
``argparse.Namespace``, ``Net(cfg)`` an OmegaConf ``DictConfig`` or a dict of lists, a Hugging
Face ``PretrainedConfig`` (``config_hf_models``); each one's norm takes its ``eps`` from the config."""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

DIM = 8


class Act(enum.Enum):
    GELU = "gelu"
    RELU = "relu"


@dataclass(frozen=True)
class NormConfig:
    eps: float = 1e-5
    layer: object = nn.LayerNorm


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 1
    norm: NormConfig = field(default_factory=NormConfig)
    widths: tuple = (DIM, 3)
    act: Act = Act.GELU
    dtype: torch.dtype = torch.float64
    out: Path = Path("out")
    act_layer: object = nn.GELU
    norm_layer: object = functools.partial(nn.LayerNorm, eps=1e-6)


class GPT(nn.Module):
    """Blocks of ``norm_layer(DIM)`` then ``fc``, as many as ``config.n_layer``."""

    def __init__(self, config: GPTConfig = GPTConfig()):
        super().__init__()
        self.config = config
        assert config.dtype == torch.float32 and config.act is Act.RELU
        assert isinstance(config.out, Path)
        self.norms = nn.ModuleList(config.norm_layer(DIM) for _ in range(config.n_layer))
        self.fcs = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(config.n_layer))
        self.act = config.act_layer()
        self.head = nn.Linear(*config.widths)

    def forward(self, x):
        for norm, fc in zip(self.norms, self.fcs):
            x = x + self.act(fc(norm(x)))
        return self.head(x)


class ArgsNet(nn.Module):
    """``Net(args)``: an argparse Namespace, or a mapping (a dict, an OmegaConf DictConfig)."""

    def __init__(self, args):
        super().__init__()
        self.args = args
        get = args.get if hasattr(args, "get") else lambda k: getattr(args, k)
        self.norm = nn.LayerNorm(DIM, eps=get("eps"))
        widths = list(get("widths"))
        self.fcs = nn.Sequential(*[nn.Linear(a, b) for a, b in zip(widths, widths[1:])])

    def forward(self, x):
        return self.fcs(self.norm(x))


class ActNet(nn.Module):
    """Takes its activation as a callable it keeps: a lambda is no data."""

    def __init__(self, act):
        super().__init__()
        self.act = act
        self.fc = nn.Linear(DIM, 3)

    def forward(self, x):
        return self.fc(self.act(x))


class Attention(nn.Module):
    """Causal self-attention whose logits are scaled after the mask (``config.attn_scale``)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.head = nn.Linear(DIM, 3)

    def forward(self, x):  # (B, T, DIM)
        q, k, v = self.qkv(x).chunk(3, -1)
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        att = (q @ k.transpose(-1, -2)).masked_fill(causal, float("-inf"))
        att = (att * self.config.attn_scale).softmax(-1)
        return self.head((att @ v).mean(1))


class NamedActNet(nn.Module):
    """Keeps under its argument's name the function that argument named: called with it, the
    constructor raises, so the replay builds the class with its defaults, as the run did."""

    def __init__(self, act: str = "relu"):
        super().__init__()
        self.act = {"relu": torch.relu, "tanh": torch.tanh}[act]
        self.norm = nn.LayerNorm(DIM, eps=0.0)
        self.fc = nn.Linear(DIM, 3)

    def forward(self, x):
        return self.fc(self.act(self.norm(x)))
