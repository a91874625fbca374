"""Models with planted numerical bugs for the cause tests (``tests/test_causes.py``) and the
backward-sample tests (``tests/test_backward_samples.py``).

As in ``replay_models``, every bug comes back from what a bundle holds: it fires on a row the
loop plants at a known step (a zero row, a large value, a duplicated pair), so the replay
rebuilds it from the batch. Factories are named ``make_*``; tests record with
``factory="cause_models:make_*"`` and replay from this directory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

D_IN, HIDDEN, N_CLASSES = 4, 8, 3


# ---------------------------------------------------------------------------------------------
# invalid: a pole (x/0 at 0/0, rsqrt(0))


class RowShare(nn.Module):
    """Each feature's share of its row's L1 norm: 0/0 for a row whose features are all 0."""

    def forward(self, h):
        h = h.abs()
        return h / h.sum(dim=-1, keepdim=True)  # BUG: no eps in the denominator


class ShareNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, HIDDEN, bias=False)  # a zero input row stays zero
        self.share = RowShare()
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x):
        return self.head(self.share(self.lin(x)))


def make_share_net() -> nn.Module:
    return ShareNet()


def make_nested_share_net() -> nn.Module:
    """:class:`ShareNet`'s row share two plain ``Sequential``s deep, behind ``nn.Identity``s:
    containers whose output is always another call's, which the recorder does not hook."""
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Identity(), RowShare())
    return nn.Sequential(nn.Identity(), nn.Sequential(nn.Linear(D_IN, HIDDEN, bias=False), inner),
                         nn.Linear(HIDDEN, N_CLASSES))


def make_tanh_net() -> nn.Module:
    """A tanh after the first layer saturates an infinite input feature to +-1, so the forward
    stays finite; the first layer's weight gradient, ``grad.T @ x``, meets the infinity."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, N_CLASSES))


class SoftClip(nn.Module):
    """exp below 20, the identity above: ``torch.where`` masks exp's overflow in the forward,
    and exp's derivative meets it in the backward (inf * 0)."""

    def forward(self, x):
        return torch.where(x < 20, torch.exp(x), x)  # BUG: masks exp's output, not its input


def _after_identity(middle: nn.Module) -> nn.Module:
    """An identity first layer (so the gradient has a weight to reach, and ``middle`` sees the
    batch's values), ``middle``, a head."""
    torch.manual_seed(0)
    first = nn.Linear(D_IN, D_IN)
    with torch.no_grad():
        first.weight.copy_(torch.eye(D_IN))
        first.bias.zero_()
    return nn.Sequential(first, middle, nn.Linear(D_IN, N_CLASSES))


def make_soft_clip_net() -> nn.Module:
    return _after_identity(SoftClip())


class NoiseScale(nn.Module):
    """sqrt(1 - alpha_bar), alpha_bar = sigmoid(x): a diffusion schedule's noise scale. Near
    x = 20, sigmoid(x) rounds to 1 in float32 and 1 - alpha_bar to 0 (float64 keeps 2e-9): the
    forward is 0, sqrt's derivative at 0 is infinite."""

    def forward(self, x):
        return torch.sqrt(1 - torch.sigmoid(x))  # BUG: 1 - sigmoid(x) instead of sigmoid(-x)


def make_noise_scale_net() -> nn.Module:
    return _after_identity(NoiseScale())


class LogVarStd(nn.Module):
    """A VAE's standard deviation from its log-variance, written ``sqrt(exp(logvar))``: at a
    log-variance of -120, exp underflows to 0 in float32 (8e-53 in float64), the forward is
    0 and finite, and sqrt's derivative at 0 is infinite."""

    def forward(self, logvar):
        return torch.sqrt(torch.exp(logvar))  # BUG: exp(0.5 * logvar) never reaches 0


def make_logvar_std_net() -> nn.Module:
    return _after_identity(LogVarStd())


class MaskedSqrt(nn.Module):
    """sqrt(x + 5) where that is defined, else 0: ``torch.where`` masks sqrt's NaN of a
    negative in the forward, and sqrt's derivative meets it in the backward (0 / NaN)."""

    def forward(self, x):
        return torch.where(x >= -5, torch.sqrt(x + 5), 0.0)  # BUG: masks sqrt's output


def make_masked_sqrt_net() -> nn.Module:
    return _after_identity(MaskedSqrt())


class SafeInverse(nn.Module):
    """1/h where h is not 0, else 0: ``torch.where`` masks 1/0 in the forward, and the
    reciprocal's derivative multiplies the saved +inf by the masked 0."""

    def forward(self, h):
        return torch.where(h != 0, 1 / h, 0.0)  # BUG: masks the reciprocal's output


def make_safe_inverse_net() -> nn.Module:
    torch.manual_seed(0)  # (no bias: a zero input row stays exactly 0)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN, bias=False), SafeInverse(),
                         nn.Linear(HIDDEN, N_CLASSES))


def make_weight_norm_net() -> nn.Module:
    """``weight_norm``'s weight, ``g * v / ||v||`` row by row, is made in the forward (by a
    parametrization module): a row with ``g`` and ``v`` both 0 is 0/0 there. Its dim 0 (16
    rows) is not the batch's."""
    from torch.nn.utils.parametrizations import weight_norm

    torch.manual_seed(0)
    return nn.Sequential(weight_norm(nn.Linear(D_IN, 16)), nn.ReLU(), nn.Linear(16, N_CLASSES))


class RMSNormNoEps(nn.Module):
    """RMSNorm written without its eps: rsqrt(0) = inf for an all-zero row."""

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True))  # BUG: no eps


class RMSNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, HIDDEN, bias=False)
        self.norm = RMSNormNoEps()
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x):
        return self.head(self.norm(self.lin(x)))


def make_rms_net() -> nn.Module:
    return RMSNet()


class LogEnergy(nn.Module):
    """Appends each row's log-energy (an audio feature): log(0) = -inf for a silent row,
    whose energy is exactly 0, not rounded to it."""

    def forward(self, h):
        energy = (h * h).sum(dim=-1, keepdim=True)
        return torch.cat([h, torch.log(energy)], dim=-1)  # BUG: no floor under the log


class EnergyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, HIDDEN, bias=False)
        self.energy = LogEnergy()
        self.head = nn.Linear(HIDDEN + 1, N_CLASSES)

    def forward(self, x):
        return self.head(self.energy(self.lin(x)))


def make_energy_net() -> nn.Module:
    return EnergyNet()


class BatchStandardize(nn.Module):
    """Standardises each feature over the batch with torch.std: a batch of one sample (the
    last, short batch of an epoch) has no spread to divide by, std = 0/0."""

    def forward(self, x):
        return (x - x.mean(dim=0)) / (x.std(dim=0) + 1e-5)  # BUG: std of a 1-sample batch


def make_batch_standardize() -> nn.Module:
    return nn.Sequential(BatchStandardize(), nn.Linear(D_IN, N_CLASSES))


# ---------------------------------------------------------------------------------------------
# overflow: exp of a large input


class Exp(nn.Module):
    def forward(self, x):
        return torch.exp(x)  # BUG: unbounded


def make_exp_first() -> nn.Module:
    return nn.Sequential(Exp(), nn.Linear(D_IN, N_CLASSES))


class HighPower(nn.Module):
    """A polynomial feature of a high degree (x ** 40), unbounded."""

    def forward(self, x):
        return x ** 40


def make_power_first() -> nn.Module:
    return nn.Sequential(HighPower(), nn.Linear(D_IN, N_CLASSES))


# ---------------------------------------------------------------------------------------------
# underflow: log of a softmax probability


class NaiveLogSoftmax(nn.Module):
    """log(softmax(x)): a probability that underflows to 0 gives -inf (log_softmax does not)."""

    def forward(self, x):
        return torch.log(torch.softmax(x, dim=-1))  # BUG: log of a probability


def make_naive_log_softmax() -> nn.Module:
    return nn.Sequential(NaiveLogSoftmax(), nn.Linear(D_IN, N_CLASSES))


# ---------------------------------------------------------------------------------------------
# precision: a standard deviation from E[x²] - E[x]²


class OnePassNorm(nn.Module):
    """Normalises each row by a one-pass variance, E[x²] - E[x]²: for a row with a large
    mean and a small spread, float32 cancels it below 0 and sqrt makes NaN."""

    def forward(self, x):
        mean = x.mean(dim=-1, keepdim=True)
        var = (x * x).mean(dim=-1, keepdim=True) - mean * mean  # BUG: cancellation
        return (x - mean) / torch.sqrt(var + 1e-6)


def make_one_pass_norm() -> nn.Module:
    return nn.Sequential(OnePassNorm(), nn.Linear(D_IN, N_CLASSES))


# ---------------------------------------------------------------------------------------------
# invalid: a CTC target that cannot be aligned


class CTCNet(nn.Module):
    """Frames (N, T, D) in, log-probabilities (T, N, C) out, as nn.CTCLoss takes them."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.lin = nn.Linear(D_IN, classes)

    def forward(self, x):
        return self.lin(x).log_softmax(-1).transpose(0, 1)


def make_ctc_net() -> nn.Module:
    return CTCNet()


# ---------------------------------------------------------------------------------------------
# backward only: the torch.where gradient trap, a distance between identical embeddings


class MaskedLog(nn.Module):
    """log where positive, 0 elsewhere: the forward is finite, but where's gradient flows into
    the log branch too, and log's derivative 1/x is 0/0 where x = 0 and the incoming 0."""

    def forward(self, x):
        return torch.where(x > 0, torch.log(x), torch.zeros_like(x))  # BUG: the where trap


class WhereNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, HIDDEN, bias=False)  # a zero input row stays zero
        self.logf = MaskedLog()
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x):
        h = self.lin(x)
        return self.head(self.logf(h * h))


def make_where_net() -> nn.Module:
    return WhereNet()


class Distance(nn.Module):
    """Euclidean distance of two embeddings: sqrt at 0 when they are equal (derivative inf)."""

    def forward(self, a, b):
        return torch.sqrt(((a - b) ** 2).sum(dim=-1))  # BUG: no eps under the sqrt


class SiameseNet(nn.Module):
    """Embeds a pair of inputs and scores them by their distance (a metric-learning head)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(D_IN, HIDDEN)
        self.dist = Distance()
        self.head = nn.Linear(1, N_CLASSES)

    def forward(self, x1, x2):
        d = self.dist(self.embed(x1), self.embed(x2))
        return self.head(d[:, None])


def make_siamese_net() -> nn.Module:
    return SiameseNet()


# ---------------------------------------------------------------------------------------------
# a deep MLP that a badly scaled batch breaks at its last activation


class ShiftedLog(nn.Module):
    """log(x + 3): finite for the small activations of normal batches, NaN below -3."""

    def forward(self, x):
        return torch.log(x + 3.0)  # BUG: no clamp


def make_deep_log_net(depth: int = 5) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(D_IN, HIDDEN), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(HIDDEN, HIDDEN), nn.ReLU()]
    layers += [nn.Linear(HIDDEN, HIDDEN), ShiftedLog(), nn.Linear(HIDDEN, N_CLASSES)]
    return nn.Sequential(*layers)


# ---------------------------------------------------------------------------------------------
# invalid: nn.MultiheadAttention over a sample that is all padding


class PaddedAttentionNet(nn.Module):
    """Token ids and a key-padding mask (True = padding) into nn.MultiheadAttention, as
    PyTorch's tutorials write it: a sample that is padding only (an empty sequence) leaves its
    queries no key, so the attention weights' softmax is NaN for that row."""

    def __init__(self, vocab: int = 11, dim: int = 8, batch_first: bool = True):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=batch_first)
        self.head = nn.Linear(dim, N_CLASSES)
        self.time = 1 if batch_first else 0

    def forward(self, ids, pad):
        x = self.tok(ids)
        h, _ = self.attn(x, x, x, key_padding_mask=pad)  # BUG: an all-padding row
        return self.head(h.mean(dim=self.time))


def make_padded_attention_net() -> nn.Module:
    return PaddedAttentionNet()


def make_seq_first_attention_net() -> nn.Module:
    """The same as nn.MultiheadAttention's default takes it: ids ``(T, B)``, so the attention
    output is ``(T, B, dim)`` and its samples are dim 1 (the mask stays ``(B, T)``)."""
    torch.manual_seed(0)
    return PaddedAttentionNet(batch_first=False)


class SeqFirstLSTM(nn.Module):
    """``nn.LSTM`` as it comes (``batch_first=False``): ``(T, B, F)`` in, the last step's
    state classified."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(D_IN, HIDDEN)
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x):
        h, _ = self.lstm(x)
        return self.head(h[-1])


def make_seq_first_lstm() -> nn.Module:
    torch.manual_seed(0)
    return SeqFirstLSTM()


# ---------------------------------------------------------------------------------------------
# precision: a hand-written binary cross entropy


class NaiveBCE(nn.Module):
    """-(y log p + (1 - y) log(1 - p)) with p = sigmoid(z): for a confident logit (z > 17),
    p rounds to 1 in float32 and 1 - p to 0, so log(1 - p) = -inf; exact arithmetic, and
    float64, keep 1 - p = 2e-9 > 0. ``reduction`` as torch losses have it."""

    def __init__(self, reduction: str = "mean"):
        super().__init__()
        self.reduction = reduction

    def forward(self, z, y):
        p = torch.sigmoid(z.squeeze(-1))
        per_row = -(y * torch.log(p) + (1 - y) * torch.log(1 - p))  # BUG: not in log space
        return per_row.mean() if self.reduction == "mean" else per_row


def make_naive_bce() -> dict:
    return {"model": nn.Linear(D_IN, 1), "loss_fn": NaiveBCE()}


def make_tanh_regressor() -> nn.Module:
    """PyTorch's own modules only, float32: a regressor whose learning rate a bad schedule
    multiplies by 2000, so its weights and gradients grow until backward overflows."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 1))


class _Sqrt(torch.autograd.Function):
    """A hand-written sqrt whose backward forgets the pole at 0 (a custom op's usual bug)."""

    @staticmethod
    def forward(ctx, x):
        y = x.sqrt()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad / (2 * y)  # BUG: 1/0 where the input was 0


class CustomFunctionNet(nn.Module):
    """The custom function is applied by this module's own code, between two layers."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, HIDDEN, bias=False)  # a zero input row stays zero
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x):
        return self.head(_Sqrt.apply(self.lin(x) ** 2))


def make_custom_function_net() -> nn.Module:
    torch.manual_seed(0)
    return CustomFunctionNet()


class GainNet(nn.Module):
    """Hidden features scaled by a learned gain kept non-negative by hand, ``sqrt(|g|)``, one
    gain per feature: as many as the batch has rows (HIDDEN == BATCH)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, HIDDEN)
        self.gain = nn.Parameter(torch.ones(HIDDEN))
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x):
        return self.head(torch.relu(self.lin(x)) * self.gain.abs().sqrt())


def make_gain_net() -> nn.Module:
    torch.manual_seed(0)
    return GainNet()


class Angle(nn.Module):
    """The angle between the two halves of each row: acos of the cosine of their unit vectors,
    without a clamp to [-1, 1] (a geodesic distance, an ArcFace margin)."""

    def forward(self, x):
        a, b = F.normalize(x[:, :2], dim=-1), F.normalize(x[:, 2:], dim=-1)
        return torch.acos((a * b).sum(-1, keepdim=True))


def make_angle_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Angle(), nn.Linear(1, N_CLASSES))


class HalfRMSNorm(nn.Module):
    """RMSNorm with an eps meant for float32: 1e-12 is 0 in float16, so a row whose mean
    square underflows float16 gets rsqrt(0)."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-12)


def make_half_rms_net() -> nn.Module:
    """Trained in float16 throughout (model.half()), its output cast to float32 for the loss."""
    torch.manual_seed(0)
    return nn.Sequential(HalfRMSNorm(D_IN), nn.Linear(D_IN, N_CLASSES)).half()


class _AbsLog(torch.autograd.Function):
    """log(1 + |r|), its derivative sign(r) / (1 + |r|) written by hand as r / (|r| (1 + |r|)),
    0/0 at a residual of exactly 0 (a removable singularity the formula keeps)."""

    @staticmethod
    def forward(ctx, r):
        ctx.save_for_backward(r)
        return torch.log1p(r.abs())

    @staticmethod
    def backward(ctx, g):
        (r,) = ctx.saved_tensors
        return g * r / (r.abs() * (1 + r.abs()))  # BUG: 0/0 at r == 0


class AbsLogLoss(nn.Module):
    def forward(self, pred, y):
        return _AbsLog.apply(pred - y).mean()


def make_regressor() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1),
                         nn.Flatten(0))


def make_count_model() -> nn.Module:
    """The log rate of a count regression (a Poisson GLM's linear predictor, by an MLP)."""
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


class TwinAngle(nn.Module):
    """A siamese pair in one row: the first and second halves of the features embedded by
    one layer, and the angle between their unit embeddings as ``acos`` of their dot (beside
    the first embedding). A row whose two halves are the same is the pair of a record with
    itself: its cosine is 1 in exact arithmetic, where acos's derivative is infinite."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(D_IN // 2, D_IN // 2)

    def forward(self, x):
        a, b = (F.normalize(self.embed(v), dim=-1) for v in x.chunk(2, dim=-1))
        angle = torch.acos((a * b).sum(-1, keepdim=True))  # BUG: no clamp(-1 + eps, 1 - eps)
        return torch.cat([a, angle], -1)


def make_twin_angle_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(TwinAngle(), nn.Linear(D_IN // 2 + 1, N_CLASSES))
