"""Self-supervised and distillation models for ``test_ssl_models``, written as their repos
write them: MoCo (facebookresearch/moco's ``builder.py``) with a key encoder updated by momentum
inside the forward and a queue of keys written in place every step.

The factories live at module level so that ``nanreplay`` rebuilds them from the bundle
(``ssl_models:make_moco``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def _encoder(dim: int) -> nn.Module:
    return nn.Sequential(nn.Linear(12, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, dim))


class MoCo(nn.Module):
    """The query encoder is trained; the key encoder follows it by momentum (its parameters
    do not require grad, but are in the optimizer: ``SGD(model.parameters())``); the forward
    returns the logits and the labels (0: the positive key comes first)."""

    def __init__(self, dim: int = 8, K: int = 32, m: float = 0.99, T: float = 0.07):
        super().__init__()
        self.K, self.m, self.T = K, m, T
        self.encoder_q = _encoder(dim)
        self.encoder_k = _encoder(dim)
        for param_q, param_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            param_k.data.copy_(param_q.data)
            param_k.requires_grad = False
        self.register_buffer("queue", F.normalize(torch.randn(dim, K), dim=0))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    @torch.no_grad()
    def _momentum_update_key_encoder(self):
        for param_q, param_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            param_k.data = param_k.data * self.m + param_q.data * (1.0 - self.m)

    @torch.no_grad()
    def _dequeue_and_enqueue(self, keys):
        ptr, n = int(self.queue_ptr), keys.shape[0]
        self.queue[:, ptr:ptr + n] = keys.T
        self.queue_ptr[0] = (ptr + n) % self.K

    def forward(self, im_q, im_k):
        q = F.normalize(self.encoder_q(im_q), dim=1)
        with torch.no_grad():
            self._momentum_update_key_encoder()
            k = F.normalize(self.encoder_k(im_k), dim=1)
        l_pos = torch.einsum("nc,nc->n", [q, k]).unsqueeze(-1)
        l_neg = torch.einsum("nc,ck->nk", [q, self.queue.clone().detach()])
        logits = torch.cat([l_pos, l_neg], dim=1) / self.T
        labels = torch.zeros(logits.shape[0], dtype=torch.long)
        self._dequeue_and_enqueue(k)
        return logits, labels


def make_moco() -> nn.Module:
    torch.manual_seed(0)
    return MoCo()
