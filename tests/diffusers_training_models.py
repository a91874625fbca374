"""Diffusion-model training with the real Hugging Face diffusers library, as its example
training scripts write it (``train_text_to_image.py``, ``train_unconditional.py``): a tiny
``UNet2DConditionModel`` built from arguments (no downloads), ``DDPMScheduler.add_noise``,
epsilon or v-prediction targets (``get_velocity``), min-SNR-gamma loss weighting, classifier-free
guidance dropout of the conditioning, AdamW with diffusers' cosine schedule, EMA, clipping.

Planted failures (each a switch of the data or of the loss/scheduler the test builds):
``X0Loss`` over a zero-terminal-SNR schedule (x0 divided by sqrt(alphas_cumprod[t]), 0 at the
last t); ``loader(bad=...)`` a decoded image holding NaN; ``MinSnrLoss`` over a zero-terminal-SNR
schedule with epsilon prediction (snr 0 at the last timestep: min(snr, gamma) / snr is 0/0);
``loader(scale=...)`` text-encoder states taken without their final layer norm, which float16
autocast casts past 65504 in the cross-attention key projection; a whole batch's conditioning
dropped to zeros at the first step under AdamW eps=0 (the key/value projections' gradients all 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler, UNet2DConditionModel
from torch import nn
from torch.utils.data import DataLoader, Dataset

T = 100          # num_train_timesteps of the tiny schedule
CTX = 8          # cross_attention_dim
TOKENS = 5       # conditioning length
ATTN2_K = "down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k"


def make_unet(dtype: str = "float32", seed: int = 0) -> UNet2DConditionModel:
    """A 51k-parameter conditional UNet (one cross-attention down and up block)."""
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
        block_out_channels=(8, 16), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), norm_num_groups=4,
        cross_attention_dim=CTX, attention_head_dim=4)
    return unet.to(getattr(torch, dtype))


def make_scheduler(zero_snr: bool = False, prediction_type: str = "epsilon") -> DDPMScheduler:
    return DDPMScheduler(num_train_timesteps=T, beta_schedule="linear",
                         rescale_betas_zero_snr=zero_snr, prediction_type=prediction_type)


class MinSnrLoss(nn.Module):
    """The min-SNR-gamma weighted MSE of the diffusers scripts (``compute_snr``, then
    ``min(snr, gamma) / snr`` for epsilon, ``/ (snr + 1)`` for v-prediction), per sample, as a
    module holding the schedule's ``alphas_cumprod``."""

    def __init__(self, scheduler: DDPMScheduler, gamma: float = 5.0):
        super().__init__()
        self.gamma = gamma
        self.prediction_type = scheduler.config.prediction_type
        self.register_buffer("alphas_cumprod", scheduler.alphas_cumprod.clone())

    def forward(self, pred, target, timesteps):
        ac = self.alphas_cumprod[timesteps]
        snr = (ac.sqrt() / (1.0 - ac).sqrt()) ** 2
        weights = torch.minimum(snr, torch.full_like(snr, self.gamma))
        if self.prediction_type == "epsilon":
            weights = weights / snr  # 0/0 where snr is 0: a zero-terminal-SNR schedule's last t
        else:
            weights = weights / (snr + 1)
        mse = F.mse_loss(pred.float(), target.float(), reduction="none")
        return (mse.mean(dim=(1, 2, 3)) * weights).mean()


class Images(Dataset):
    """Small images in [-1, 1] with a caption embedding each; ``bad`` indices decode to NaN (a
    truncated file), ``scale`` multiplies the conditioning (states without their final norm)."""

    def __init__(self, n: int, bad: tuple = (), scale: float = 1.0, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.rand(n, 3, 8, 8, generator=g) * 2 - 1
        self.c = torch.randn(n, TOKENS, CTX, generator=g) * scale
        for i in bad:
            self.x[i, :, 2:4, 2:4] = float("nan")

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"pixel_values": self.x[i], "encoder_hidden_states": self.c[i]}


def loader(n: int = 32, batch_size: int = 4, **kw) -> DataLoader:
    return DataLoader(Images(n, **kw), batch_size=batch_size, shuffle=False)


class X0Loss(nn.Module):
    """Epsilon MSE plus an image-space term on the predicted clean sample (a perceptual or
    pixel loss on ``x0 = (x_t - sqrt(1 - a) * eps) / sqrt(a)``, what ``scheduler.step``'s
    ``pred_original_sample`` computes), the schedule's ``alphas_cumprod`` held as a buffer."""

    def __init__(self, scheduler: DDPMScheduler, weight: float = 0.1):
        super().__init__()
        self.weight = weight
        self.register_buffer("alphas_cumprod", scheduler.alphas_cumprod.clone())

    def forward(self, pred, target, timesteps, noisy, latents):
        a = self.alphas_cumprod[timesteps][:, None, None, None]
        x0 = (noisy - (1 - a).sqrt() * pred.float()) / a.sqrt()
        return F.mse_loss(pred.float(), target.float()) + self.weight * F.mse_loss(x0, latents)
