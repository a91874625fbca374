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
        assert self.K % n == 0  # for simplicity
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


class DINOStudent(nn.Module):
    """A backbone that takes crops of any size (adaptive pooling) and DINO's head: an MLP, an
    L2-normalised bottleneck and a weight-normalised last layer."""

    def __init__(self, out_dim: int = 32):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GELU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.last_layer = nn.utils.parametrizations.weight_norm(
            nn.Linear(8, out_dim, bias=False))

    def forward(self, x):
        return self.last_layer(F.normalize(self.mlp(self.backbone(x)), dim=-1))


def make_dino_student() -> nn.Module:
    torch.manual_seed(0)
    return DINOStudent()


class DINOLoss(nn.Module):
    """lightly's DINOLoss: the teacher's centred outputs sharpened by its temperature, the
    student's crops against every other teacher crop, the centre an EMA of the teacher's
    outputs (a buffer the loss replaces at each call)."""

    def __init__(self, out_dim: int = 32, teacher_temp: float = 0.04,
                 student_temp: float = 0.1, center_momentum: float = 0.9):
        super().__init__()
        self.teacher_temp, self.student_temp = teacher_temp, student_temp
        self.center_momentum = center_momentum
        self.register_buffer("center", torch.zeros(1, 1, out_dim))

    def forward(self, teacher_out, student_out):
        teacher_out = torch.stack(teacher_out)
        t_out = F.softmax((teacher_out - self.center) / self.teacher_temp, dim=-1)
        s_out = F.log_softmax(torch.stack(student_out) / self.student_temp, dim=-1)
        loss = -torch.einsum("tbk,sbk->tsb", t_out, s_out)
        mask = torch.ones(len(teacher_out), len(student_out), dtype=torch.bool)
        for i in range(len(teacher_out)):
            mask[i, i] = False
        loss = loss[mask].sum() / (teacher_out.shape[1] * mask.sum())
        with torch.no_grad():
            batch_center = teacher_out.mean(dim=(0, 1), keepdim=True)
            self.center = (self.center * self.center_momentum
                           + batch_center * (1 - self.center_momentum))
        return loss


class MoCoV3(nn.Module):
    """moco-v3's builder: the momentum ``m`` is passed to the forward, which updates the
    momentum encoder with it before computing the keys; the loss is computed inside."""

    def __init__(self, dim: int = 8, T: float = 1.0):
        super().__init__()
        self.T = T
        self.base_encoder = _encoder(dim)
        self.momentum_encoder = _encoder(dim)
        self.predictor = nn.Sequential(nn.Linear(dim, 16), nn.ReLU(), nn.Linear(16, dim))
        for param_b, param_m in zip(self.base_encoder.parameters(),
                                    self.momentum_encoder.parameters()):
            param_m.data.copy_(param_b.data)
            param_m.requires_grad = False

    @torch.no_grad()
    def _update_momentum_encoder(self, m):
        for param_b, param_m in zip(self.base_encoder.parameters(),
                                    self.momentum_encoder.parameters()):
            param_m.data = param_m.data * m + param_b.data * (1. - m)

    def contrastive_loss(self, q, k):
        logits = torch.einsum("nc,mc->nm", [F.normalize(q, dim=1), F.normalize(k, dim=1)])
        labels = torch.arange(logits.shape[0], dtype=torch.long)
        return nn.CrossEntropyLoss()(logits / self.T, labels) * (2 * self.T)

    def forward(self, x1, x2, m):
        q1 = self.predictor(self.base_encoder(x1))
        q2 = self.predictor(self.base_encoder(x2))
        with torch.no_grad():
            self._update_momentum_encoder(m)
            k1, k2 = self.momentum_encoder(x1), self.momentum_encoder(x2)
        return self.contrastive_loss(q1, k2) + self.contrastive_loss(q2, k1)


def make_moco_v3() -> nn.Module:
    torch.manual_seed(0)
    return MoCoV3()


class BYOL(nn.Module):
    """byol-pytorch's learner: the online encoder, projector and predictor train; the target
    encoder and projector are copies that require no gradient, which the loop updates by EMA
    after ``optimizer.step()`` (``update_moving_average``). The forward returns the loss."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.online_encoder = _encoder(dim)
        self.online_predictor = nn.Sequential(nn.Linear(dim, 16), nn.ReLU(), nn.Linear(16, dim))
        self.target_encoder = _encoder(dim)
        self.target_encoder.load_state_dict(self.online_encoder.state_dict())
        self.target_encoder.requires_grad_(False)

    @torch.no_grad()
    def update_moving_average(self, m: float) -> None:
        for po, pt in zip(self.online_encoder.parameters(), self.target_encoder.parameters()):
            pt.mul_(m).add_(po, alpha=1 - m)

    def forward(self, x1, x2):
        p1 = self.online_predictor(self.online_encoder(x1))
        p2 = self.online_predictor(self.online_encoder(x2))
        with torch.no_grad():
            t1, t2 = self.target_encoder(x1), self.target_encoder(x2)

        def loss_fn(x, y):
            return 2 - 2 * (F.normalize(x, dim=-1) * F.normalize(y, dim=-1)).sum(dim=-1)

        return (loss_fn(p1, t2) + loss_fn(p2, t1)).mean()


def make_byol() -> nn.Module:
    torch.manual_seed(0)
    return BYOL()


class DINOLossNumpySchedule(DINOLoss):
    """facebookresearch/dino's DINOLoss keeps its teacher temperature schedule as a NumPy
    array (warmup then constant, by epoch) and takes the epoch at each call; its constructor
    needs arguments."""

    def __init__(self, out_dim: int, warmup_teacher_temp: float, teacher_temp: float,
                 warmup_teacher_temp_epochs: int, nepochs: int):
        super().__init__(out_dim, teacher_temp)
        import numpy as np

        self.teacher_temp_schedule = np.concatenate((
            np.linspace(warmup_teacher_temp, teacher_temp, warmup_teacher_temp_epochs),
            np.ones(nepochs - warmup_teacher_temp_epochs) * teacher_temp))

    def forward(self, teacher_out, student_out, epoch):
        self.teacher_temp = float(self.teacher_temp_schedule[epoch])
        return super().forward(teacher_out, student_out)
