"""PyTorch Lightning training as its users write it: a GAN under manual optimization (two
optimizers, ``toggle_optimizer``, ``manual_backward``, ``clip_gradients``) recorded by a
``FlightRecorder`` attached to the generator in ``on_train_start``; a heteroscedastic regressor
under automatic optimization (two parameter groups, a per-step warmup scheduler, bf16-mixed,
gradient accumulation and clipping) recorded by the callback; a ``LightningDataModule`` with
real ``DataLoader``s."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder

Z, D, B = 8, 16, 8


# ---------------------------------------------------------------- data

def rows(n: int = 64, seed: int = 0, scale: float = 1.0, nan_at=()) -> TensorDataset:
    """Regression rows ``(x, mask, y)``: 16 features (the last 4 missing in odd rows, their mask
    0), a target with a noise that grows with ``|x_0|``; ``nan_at``: items whose feature 2 the
    sensor export wrote as NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g) * scale
    mask = torch.ones(n, D)
    mask[1::2, -4:] = 0.0
    y = x[:, :4].sum(1, keepdim=True) + 0.1 * (1 + x[:, :1].abs()) * torch.randn(n, 1,
                                                                                  generator=g)
    for i in nan_at:
        x[i, 2] = float("nan")
    return TensorDataset(x * mask, mask, y)


class RowsData(L.LightningDataModule):
    def __init__(self, batch_size: int = B, **kw):
        super().__init__()
        self.batch_size, self.kw = batch_size, kw

    def setup(self, stage=None):
        self.train = rows(**self.kw)
        self.val = rows(16, seed=1)

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=self.batch_size)


def real_images(n: int = 64, seed: int = 0, pixels: bool = False) -> TensorDataset:
    """4x4 "images" flattened to 16 values in [-1, 1]; ``pixels``: left as 0..255 (the
    ``Normalize`` forgotten)."""
    g = torch.Generator().manual_seed(seed)
    img = (torch.rand(n, D, generator=g) * 0.5 + torch.linspace(0, 0.5, D)).clamp(0, 1)
    return TensorDataset(img * 255.0 if pixels else img * 2 - 1)


# ---------------------------------------------------------------- GAN

class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(Z, 32), nn.LeakyReLU(0.2), nn.Linear(32, D),
                                 nn.Tanh())

    def forward(self, z):
        return self.net(z)


class Discriminator(nn.Module):
    """``mbstd``: ProGAN's minibatch standard deviation, the batch's mean feature std fed to
    the last layer as one more feature (it tells the discriminator a collapsed batch)."""

    def __init__(self, mbstd: bool = False):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D, 32), nn.LeakyReLU(0.2))
        self.head = nn.Linear(33 if mbstd else 32, 1)
        self.mbstd = mbstd

    def forward(self, x):
        h = self.body(x)
        if self.mbstd:
            s = h.std(0).mean()
            h = torch.cat([h, s.expand(h.shape[0], 1)], 1)
        return self.head(h)


def make_generator() -> Generator:
    return Generator()


class GeneratorLoss(nn.Module):
    """The non-saturating generator loss, written out: ``-log(D(G(z)))`` through the
    discriminator it holds, plus (``diversity`` > 0) a mode-seeking term on the fakes' pairwise
    distances."""

    def __init__(self, disc: nn.Module, diversity: float = 0.0):
        super().__init__()
        self.disc, self.diversity = disc, diversity

    def forward(self, fake):
        p = torch.sigmoid(self.disc(fake))
        loss = -torch.log(p).mean()
        if self.diversity:
            dist = ((fake[:, None] - fake[None]) ** 2).sum(-1).sqrt()
            loss = loss - self.diversity * dist.mean()
        return loss


def make_discriminator() -> Discriminator:
    return Discriminator()


def make_mbstd_discriminator() -> Discriminator:
    return Discriminator(mbstd=True)


class DiscriminatorLoss(nn.Module):
    """Binary cross-entropy written out from the probabilities, over real and fake rows."""

    def forward(self, logits, labels):
        p = torch.sigmoid(logits)
        return -(labels * torch.log(p) + (1 - labels) * torch.log(1 - p)).mean()


class GAN(L.LightningModule):
    """Lightning's manual-optimization GAN: the discriminator steps first (on real and fake rows
    in one batch), then the generator; a recorder watches ``watch`` ("gen" or "disc", None: no
    recorder) and its optimizer."""

    def __init__(self, out_dir=None, diversity: float = 0.0, watch: str | None = "gen",
                 mbstd: bool = False):
        super().__init__()
        self.automatic_optimization = False
        self.gen, self.disc = Generator(), Discriminator(mbstd)
        self.g_loss = GeneratorLoss(self.disc, diversity)
        self.d_loss = DiscriminatorLoss()
        self.out_dir, self.watch = out_dir, watch
        self.recorder = None
        self.steps = []  # (global_step, recorder step) as each generator step begins

    def on_train_start(self):
        if self.watch is not None:
            gen = self.watch == "gen"
            self.recorder = FlightRecorder(
                self.gen if gen else self.disc, self.optimizers()[0 if gen else 1],
                loss_fn=self.g_loss if gen else self.d_loss, out_dir=self.out_dir,
                factory="lightning_manual_models:" + (
                    "make_generator" if gen else
                    "make_mbstd_discriminator" if self.disc.mbstd else "make_discriminator"),
            ).attach()

    def on_train_end(self):
        if self.recorder is not None:
            self.recorder.detach()

    def training_step(self, batch, batch_idx):
        (x,) = batch
        g_opt, d_opt = self.optimizers()
        z = torch.randn(x.shape[0], Z, generator=None)
        fake = self.gen(z)
        ones, zeros = torch.ones(x.shape[0], 1), torch.zeros(x.shape[0], 1)

        self.toggle_optimizer(d_opt)
        d_loss = self.d_loss(self.disc(torch.cat([x, fake.detach()])), torch.cat([ones, zeros]))
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        self.clip_gradients(d_opt, gradient_clip_val=10.0, gradient_clip_algorithm="norm")
        d_opt.step()
        self.untoggle_optimizer(d_opt)

        self.toggle_optimizer(g_opt)
        self.steps.append((self.trainer.global_step, self.recorder and self.recorder.step))
        g_loss = self.g_loss(fake)
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        self.clip_gradients(g_opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        g_opt.step()
        self.untoggle_optimizer(g_opt)
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})

    def configure_optimizers(self):
        return (torch.optim.Adam(self.gen.parameters(), lr=1e-3, betas=(0.5, 0.999)),
                torch.optim.Adam(self.disc.parameters(), lr=2e-3, betas=(0.5, 0.999)))


# ---------------------------------------------------------------- regressor

class HeteroscedasticMLP(nn.Module):
    """Mean and variance heads over a shared trunk; ``mask`` zeroes missing features.
    ``var_head``: ``"softplus"`` or ``"relu"``; ``layernorm``: a hand-written LayerNorm using
    ``E[h^2] - E[h]^2`` (one pass) instead of ``nn.LayerNorm``."""

    def __init__(self, var_head: str = "softplus", layernorm: str = "torch"):
        super().__init__()
        self.trunk = nn.Linear(D, 32)
        self.norm = OnePassLayerNorm(32) if layernorm == "onepass" else nn.LayerNorm(32)
        self.mean = nn.Linear(32, 1)
        self.var = nn.Linear(32, 1)
        self.var_head = var_head

    def forward(self, x, mask):
        h = F.gelu(self.norm(self.trunk(x * mask)))
        v = self.var(h)
        var = F.relu(v) if self.var_head == "relu" else F.softplus(v) + 1e-6
        return self.mean(h), var


class OnePassLayerNorm(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(n)), nn.Parameter(torch.zeros(n))

    def forward(self, h):
        mean = h.mean(-1, keepdim=True)
        var = (h * h).mean(-1, keepdim=True) - mean * mean
        return (h - mean) / torch.sqrt(var + 1e-5) * self.weight + self.bias


def make_mlp() -> HeteroscedasticMLP:
    return HeteroscedasticMLP()


def make_relu_mlp() -> HeteroscedasticMLP:
    return HeteroscedasticMLP("relu")


def make_onepass_mlp() -> HeteroscedasticMLP:
    return HeteroscedasticMLP(layernorm="onepass")


class GaussianNLL(nn.Module):
    """The heteroscedastic negative log-likelihood from the model's two outputs."""

    def forward(self, mean, var, y):
        return (0.5 * (torch.log(var) + (y - mean) ** 2 / var)).mean()


def warmup_lambda(warmup: int, start: float = 0.01, clamp: bool = True):
    """Exponential warmup from ``start * lr`` to ``lr`` over ``warmup`` steps; ``clamp=False``:
    the ``min(step, warmup)`` forgotten, so the factor keeps growing by ``1 / start`` every
    ``warmup`` steps."""
    def factor(step: int) -> float:
        s = min(step, warmup) if clamp else step
        return start ** (1.0 - s / warmup)
    return factor


class Regressor(L.LightningModule):
    def __init__(self, var_head: str = "softplus", layernorm: str = "torch", lr: float = 1e-2,
                 warmup: int = 4, clamp: bool = True):
        super().__init__()
        self.model = HeteroscedasticMLP(var_head, layernorm)
        self.criterion = GaussianNLL()
        self.lr, self.warmup, self.clamp = lr, warmup, clamp

    def training_step(self, batch, batch_idx):
        x, mask, y = batch
        mean, var = self.model(x, mask)
        loss = self.criterion(mean, var, y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, mask, y = batch
        mean, var = self.model(x, mask)
        self.log("val_loss", self.criterion(mean, var, y))

    def configure_optimizers(self):
        m = self.model
        opt = torch.optim.AdamW([
            {"params": [*m.trunk.parameters(), *m.norm.parameters()], "weight_decay": 1e-2},
            {"params": [*m.mean.parameters(), *m.var.parameters()], "weight_decay": 0.0,
             "lr": self.lr * 0.1}], lr=self.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_lambda(self.warmup,
                                                                      clamp=self.clamp))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
