"""Sparse autoencoders on a small frozen transformer's residual stream, written as SAELens,
OpenAI's ``sparse_autoencoder`` and Anthropic's updates write them, for
``test_sparse_autoencoders``.

- ``lm_activations``: a frozen two-layer transformer (token and position embeddings, causal
  ``TransformerEncoderLayer``s) run under ``no_grad``; its residual stream after layer 1 is
  cached in an ``ActivationBuffer`` and streamed out in shuffled batches. The buffer is
  allocated with ``torch.zeros`` and refilled; a short refill leaves zero rows it still draws.
- ``ReLUSAE``: ``W_enc (x - b_dec) + b_enc``, ReLU, ``f @ W_dec + b_dec``; the L1 penalty
  weighted by each latent's decoder norm (Anthropic's April 2024 update); decoder rows set to
  unit norm after each step and the gradient's component parallel to them removed before it
  (SAELens's ``set_decoder_norm_to_unit_norm`` and
  ``remove_gradient_parallel_to_decoder_directions``); ghost grads for the latents dead for
  a while (SAELens's ``exp`` of their pre-activations, scaled to half the residual's norm),
  given to ``forward`` as a boolean mask; ``normalize_in_forward``: the decoder's rows divided
  by their norms inside ``forward`` (the constraint as a reparameterisation).
- ``TopKSAE``: OpenAI's TopK autoencoder (``topk`` then ``scatter`` into zeros, ReLU) with the
  AuxK loss of the dead latents' top pre-activations reconstructing the residual;
  ``standardize``: each input row standardised first (OpenAI's LN preprocessing, here without
  its eps), returned for the loss.
- ``JumpReLUSAE``: Gemma Scope's JumpReLU with straight-through estimators of the threshold
  (custom ``autograd.Function``s with a rectangle kernel) and the L0 penalty.
- ``normalized_mse`` (OpenAI's: each row's squared error over its squared norm),
  ``fraction_of_variance_unexplained`` (the batch's error over its variance) and ``SAELoss``
  (SAELens's MSE or one of those, plus the weighted L1 and the ghost-grad term).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

D_MODEL, N_LATENTS, N_CTX, VOCAB = 32, 128, 8, 50


# ---------------------------------------------------------------------------------------------
# The frozen transformer and its activation buffer

class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Embedding(N_CTX, D_MODEL)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(D_MODEL, 4, 64, dropout=0.0, batch_first=True,
                                       norm_first=True)
            for _ in range(2))
        # the residual stream's large mean direction (why SAEs centre on b_dec)
        self.register_buffer("mean_direction", 4.0 * torch.randn(D_MODEL))

    def forward(self, tokens, layer: int = 1):
        h = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        causal = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        for i, block in enumerate(self.layers):
            h = block(h, src_mask=causal, is_causal=True)
            if i == layer:
                break
        return h + self.mean_direction


def frozen_lm() -> TinyLM:
    torch.manual_seed(123)
    return TinyLM().eval().requires_grad_(False)


class ActivationBuffer:
    """SAELens's buffer: ``n_seqs`` contexts' activations (BOS position dropped) cached in a
    tensor allocated once, refilled and drawn from in a shuffled order. ``fill(n)`` caches
    ``n`` contexts; the draw order is a permutation of the whole buffer (the bug a short
    refill exposes: rows past the filled ones are still zeros)."""

    def __init__(self, lm: TinyLM, n_seqs: int, g: torch.Generator):
        self.lm, self.g = lm, g
        self.size = n_seqs * (N_CTX - 1)
        self.acts, self.order, self.at = torch.zeros(0, D_MODEL), torch.arange(0), 0

    @torch.no_grad()
    def fill(self, n_seqs: int, keep_bos: bool = False):
        tokens = torch.randint(1, VOCAB, (n_seqs, N_CTX), generator=self.g)
        tokens[:, 0] = 0  # BOS
        h = self.lm(tokens)
        if keep_bos:  # the attention sink's massive activations, which practitioners drop
            h[:, 0, :4] += 1000.0
            h = h[:, :N_CTX - 1]
        else:
            h = h[:, 1:]
        rows = h.reshape(-1, D_MODEL)
        self.acts = torch.zeros(self.size, D_MODEL)
        self.acts[:len(rows)] = rows
        self.order = torch.randperm(len(self.acts), generator=self.g)
        self.at = 0

    def next_batch(self, batch_size: int) -> torch.Tensor:
        idx = self.order[self.at:self.at + batch_size]
        self.at += batch_size
        return self.acts[idx].clone()


# ---------------------------------------------------------------------------------------------
# The autoencoders

class ReLUSAE(nn.Module):
    def __init__(self, d: int = D_MODEL, m: int = N_LATENTS, normalize_in_forward: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.W_dec = nn.Parameter(torch.randn(m, d))
        self.W_dec.data /= self.W_dec.data.norm(dim=-1, keepdim=True)
        self.W_enc = nn.Parameter(self.W_dec.data.t().clone())  # tied init (Anthropic)
        self.b_enc = nn.Parameter(torch.zeros(m))
        self.b_dec = nn.Parameter(torch.zeros(d))
        self.normalize_in_forward = normalize_in_forward

    def decoder(self) -> torch.Tensor:
        if self.normalize_in_forward:
            return self.W_dec / self.W_dec.norm(dim=-1, keepdim=True)
        return self.W_dec

    def forward(self, x, dead_mask=None):
        """(reconstruction, latents, decoder norms, ghost reconstruction or None)."""
        W_dec = self.decoder()
        pre = (x - self.b_dec) @ self.W_enc + self.b_enc
        f = F.relu(pre)
        x_hat = f @ W_dec + self.b_dec
        ghost = None
        if dead_mask is not None and dead_mask.any():
            # SAELens's ghost grads: the dead latents' exp(pre) decodes the residual.
            residual = (x - x_hat).detach()
            ghost = torch.exp(pre[:, dead_mask]) @ W_dec[dead_mask]
            scale = residual.norm(dim=-1) / (1e-6 + 2 * ghost.norm(dim=-1))
            ghost = ghost * scale[:, None].detach()
        return x_hat, f, W_dec.norm(dim=-1), ghost

    @torch.no_grad()
    def resample_dead(self, dead: torch.Tensor, inputs: torch.Tensor):
        """Anthropic's resampling: each dead latent's decoder row becomes an input drawn from
        the buffer (its direction: the forward normalises it), its encoder column that input
        scaled to the live columns' mean norm times 0.2, its bias 0."""
        idx = torch.nonzero(dead).flatten()
        live_norm = self.W_enc.data[:, ~dead].norm(dim=0).mean()
        self.W_dec.data[idx] = inputs[:len(idx)]
        unit = inputs[:len(idx)] / inputs[:len(idx)].norm(dim=-1, keepdim=True).clamp_min(1e-8)
        self.W_enc.data[:, idx] = (unit * live_norm * 0.2).t()
        self.b_enc.data[idx] = 0.0

    @torch.no_grad()
    def reset_adam_state(self, opt: torch.optim.Optimizer, dead: torch.Tensor):
        """Anthropic's reset of the resampled latents' Adam moments (rows of W_dec, columns
        of W_enc, entries of b_enc), so stale momentum does not undo the resampling."""
        for p, rows in ((self.W_dec, dead), (self.W_enc, (slice(None), dead)),
                        (self.b_enc, dead)):
            for key in ("exp_avg", "exp_avg_sq"):
                if key in opt.state.get(p, {}):
                    opt.state[p][key][rows] = 0.0

    @torch.no_grad()
    def set_decoder_norm_to_unit_norm(self):
        self.W_dec.data /= self.W_dec.data.norm(dim=-1, keepdim=True)

    @torch.no_grad()
    def remove_gradient_parallel_to_decoder_directions(self):
        parallel = (self.W_dec.grad * self.W_dec.data).sum(-1, keepdim=True)
        self.W_dec.grad -= parallel * self.W_dec.data


class TopKSAE(nn.Module):
    def __init__(self, d: int = D_MODEL, m: int = N_LATENTS, k: int = 8, k_aux: int = 16,
                 standardize: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(d, m, bias=False)
        self.decoder = nn.Linear(m, d, bias=False)
        self.decoder.weight.data = self.encoder.weight.data.t().clone()
        self.decoder.weight.data /= self.decoder.weight.data.norm(dim=0, keepdim=True)
        self.pre_bias = nn.Parameter(torch.zeros(d))
        self.latent_bias = nn.Parameter(torch.zeros(m))
        self.k, self.k_aux, self.standardize = k, k_aux, standardize

    def forward(self, x, dead_mask):
        if self.standardize:  # OpenAI's LN preprocessing (theirs has an eps; this one not)
            mu = x.mean(-1, keepdim=True)
            x = (x - mu) / x.std(-1, keepdim=True)
        pre = self.encoder(x - self.pre_bias) + self.latent_bias
        values, idx = torch.topk(pre, self.k, dim=-1)
        f = torch.zeros_like(pre).scatter(-1, idx, F.relu(values))
        x_hat = self.decoder(f) + self.pre_bias
        # AuxK: the dead latents' top pre-activations model the residual.
        aux_pre = pre.masked_fill(~dead_mask, float("-inf"))
        aux_vals, aux_idx = torch.topk(aux_pre, self.k_aux, dim=-1)
        aux_f = torch.zeros_like(pre).scatter(-1, aux_idx, F.relu(aux_vals))
        return x_hat, f, self.decoder(aux_f), x


class JumpReLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, threshold, bandwidth):
        ctx.save_for_backward(x, threshold)
        ctx.bandwidth = bandwidth
        return x * (x > threshold)

    @staticmethod
    def backward(ctx, grad):
        x, threshold = ctx.saved_tensors
        bw = ctx.bandwidth
        rect = ((x - threshold).abs() < bw / 2).to(x.dtype)
        return grad * (x > threshold), (-(threshold / bw) * rect * grad).sum(0), None


class Step(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, threshold, bandwidth):
        ctx.save_for_backward(x, threshold)
        ctx.bandwidth = bandwidth
        return (x > threshold).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, threshold = ctx.saved_tensors
        bw = ctx.bandwidth
        rect = ((x - threshold).abs() < bw / 2).to(x.dtype)
        return torch.zeros_like(x), (-(1.0 / bw) * rect * grad).sum(0), None


class JumpReLUSAE(nn.Module):
    def __init__(self, d: int = D_MODEL, m: int = N_LATENTS, bandwidth: float = 0.05):
        super().__init__()
        torch.manual_seed(0)
        self.W_enc = nn.Parameter(torch.randn(d, m) / d ** 0.5)
        self.W_dec = nn.Parameter(self.W_enc.data.t().clone())
        self.b_enc = nn.Parameter(torch.zeros(m))
        self.b_dec = nn.Parameter(torch.zeros(d))
        self.log_threshold = nn.Parameter(torch.full((m,), -1.0))
        self.bandwidth = bandwidth

    def forward(self, x):
        pre = F.relu((x - self.b_dec) @ self.W_enc + self.b_enc)
        threshold = self.log_threshold.exp()
        f = JumpReLU.apply(pre, threshold, self.bandwidth)
        l0 = Step.apply(pre, threshold, self.bandwidth).sum(-1)
        return f @ self.W_dec + self.b_dec, f, l0


def make_relu() -> ReLUSAE:
    return ReLUSAE()


def make_relu_normalized() -> ReLUSAE:
    return ReLUSAE(normalize_in_forward=True)


def make_topk() -> TopKSAE:
    return TopKSAE()


def make_topk_standardized() -> TopKSAE:
    return TopKSAE(standardize=True)


def make_jumprelu() -> JumpReLUSAE:
    return JumpReLUSAE()


@torch.no_grad()
def geometric_median(points: torch.Tensor, iters: int = 20) -> torch.Tensor:
    """Weiszfeld's iteration from the mean, as SAELens initialises ``b_dec`` from the first
    buffer's activations: each step a mean weighted by the inverse distances."""
    median = points.mean(0)
    for _ in range(iters):
        weights = 1 / (points - median).norm(dim=1)
        median = (weights[:, None] * points).sum(0) / weights.sum()
    return median


# ---------------------------------------------------------------------------------------------
# Losses

def fraction_of_variance_unexplained(x_hat, x):
    """SAELens's FVU: the batch's squared error over its total variance about the mean."""
    return ((x_hat - x) ** 2).sum() / ((x - x.mean(0)) ** 2).sum()


def normalized_mse(x_hat, x):
    """OpenAI's ``normalized_mean_squared_error``: each row's error over its squared norm."""
    return (((x_hat - x) ** 2).mean(dim=1) / (x ** 2).mean(dim=1)).mean()


class SAELoss(nn.Module):
    """SAELens's training loss: MSE, the decoder-norm-weighted L1 and the ghost-grad MSE
    (scaled by the residual's norm per row)."""

    def __init__(self, l1_coefficient: float = 1e-3, normalized: str | None = None):
        super().__init__()
        self.l1_coefficient = l1_coefficient
        self.normalized = normalized

    def forward(self, x_hat, f, dec_norms, ghost, x):
        mse = {"rows": normalized_mse, "fvu": fraction_of_variance_unexplained}.get(
            self.normalized, F.mse_loss)(x_hat, x)
        l1 = (f * dec_norms).sum(-1).mean()
        loss = mse + self.l1_coefficient * l1
        if ghost is not None:
            residual = (x - x_hat).detach()
            ghost_mse = (ghost - residual) ** 2 / residual.pow(2).sum(-1, keepdim=True).sqrt()
            loss = loss + ghost_mse.mean()
        return loss


def topk_loss(x_hat, f, aux_recon, x, aux_coeff: float = 1 / 32):
    """MSE against the input the SAE saw (standardised, when it standardises: ``x``)."""
    residual = (x - x_hat).detach()
    return F.mse_loss(x_hat, x) + aux_coeff * F.mse_loss(aux_recon, residual)


def jumprelu_loss(x_hat, f, l0, x, sparsity_coefficient: float = 1e-3):
    return ((x_hat - x) ** 2).sum(-1).mean() + sparsity_coefficient * l0.mean()
