"""Models of the precision fuzz's findings (tests/test_precision_fuzz_found.py): a small
attention classifier built from torch's own modules, trained in bfloat16 or float16."""

import torch
from torch import nn

D = 16


class AttnClassifier(nn.Module):
    """Features projected, self-attention with a padding mask, mean pooled, a linear head."""

    def __init__(self, d_in: int = 8, n_classes: int = 4):
        super().__init__()
        self.inp = nn.Linear(d_in, D)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.head = nn.Linear(D, n_classes)

    def forward(self, x, pad):
        h = self.inp(x)
        h = h + self.attn(h, h, h, key_padding_mask=pad, need_weights=False)[0]
        return self.head(h.mean(1))


def make_bf16_classifier() -> nn.Module:
    torch.manual_seed(0)
    return AttnClassifier().to(torch.bfloat16)
