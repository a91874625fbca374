"""Self-supervised speech and neural audio codecs as fairseq's wav2vec 2.0 and EnCodec /
SoundStream / HiFi-GAN repositories write them, for ``test_speech_ssl``.

wav2vec 2.0: a conv feature encoder over raw waveforms (GroupNorm on the first layer, fairseq's
"default" mode), a LayerNorm and projection, time masking with a learned ``mask_emb``, a conv
positional embedding and a Transformer over the padded batch (``src_key_padding_mask``), a
Gumbel-softmax product quantizer (``F.gumbel_softmax(hard=True)``, temperature annealed by
``set_num_updates``), distractors sampled from the masked frames of the same utterance,
cosine similarity / temperature with the true target first, fairseq's ``-inf`` for a
distractor identical to its target, and the diversity loss from the perplexity of the averaged
softmax. Variable-length clips are zero-padded by a ``collate_fn`` returning a padding mask.

Codec: a strided conv encoder, residual vector quantization (EMA codebooks with Laplace
smoothing, dead-code replacement, straight-through, commitment loss), a transposed-conv
decoder; a multi-scale STFT loss with log magnitudes; a multi-period discriminator with LSGAN
losses trained by its own optimizer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

CONV = [(32, 10, 5), (32, 3, 2), (32, 3, 2)]  # (dim, kernel, stride): a 20x downsampling
EMBED, G, V, NEG, N_MASK = 48, 2, 16, 6, 6  # model dim, groups, entries, distractors, masked


# ---------------------------------------------------------------------------------------------
# wav2vec 2.0


class ConvFeatureExtractor(nn.Module):
    """fairseq's ``ConvFeatureExtractionModel`` in "default" mode: GroupNorm (one group per
    channel) after the first conv only, GELU, no bias."""

    def __init__(self):
        super().__init__()
        layers, in_d = [], 1
        for i, (dim, k, stride) in enumerate(CONV):
            block = [nn.Conv1d(in_d, dim, k, stride=stride, bias=False)]
            if i == 0:
                block.append(nn.GroupNorm(dim, dim, affine=True))
            layers.append(nn.Sequential(*block, nn.GELU()))
            in_d = dim
        self.conv_layers = nn.ModuleList(layers)

    def forward(self, x):  # (B, T) -> (B, C, frames)
        x = x.unsqueeze(1)
        for conv in self.conv_layers:
            x = conv(x)
        return x


def feat_lengths(lengths):
    for _, k, stride in CONV:
        lengths = torch.div(lengths - k, stride, rounding_mode="floor") + 1
    return lengths


class GumbelVectorQuantizer(nn.Module):
    """fairseq's ``GumbelVectorQuantizer``: G groups of V entries, logits from a linear
    projection initialised N(0, 1), a hard Gumbel-softmax sample in training."""

    def __init__(self, dim: int, vq_dim: int, temp=(2.0, 0.5, 0.9), log_eps: float = 1e-7):
        super().__init__()
        self.num_vars = G * V
        self.vars = nn.Parameter(torch.FloatTensor(1, G * V, vq_dim // G).uniform_())
        self.weight_proj = nn.Linear(dim, G * V)
        nn.init.normal_(self.weight_proj.weight, mean=0, std=1)
        nn.init.zeros_(self.weight_proj.bias)
        self.max_temp, self.min_temp, self.temp_decay = temp
        self.curr_temp = self.max_temp
        self.log_eps = log_eps

    def set_num_updates(self, num_updates: int):
        self.curr_temp = max(self.max_temp * self.temp_decay ** num_updates, self.min_temp)

    def forward(self, x):  # (N, dim) -> (N, vq_dim), prob_perplexity, code_perplexity
        n = x.shape[0]
        x = self.weight_proj(x).view(n * G, -1)
        k = x.argmax(-1)
        hard_x = x.new_zeros(x.shape).scatter_(-1, k.view(-1, 1), 1.0).view(n, G, -1)
        hard_probs = hard_x.float().mean(dim=0)
        code_ppl = torch.exp(-torch.sum(hard_probs * torch.log(hard_probs + self.log_eps),
                                        dim=-1)).sum()
        avg_probs = torch.softmax(x.view(n, G, -1).float(), dim=-1).mean(dim=0)
        prob_ppl = torch.exp(-torch.sum(avg_probs * torch.log(avg_probs + 1e-7), dim=-1)).sum()
        if self.training:
            x = F.gumbel_softmax(x.float(), tau=self.curr_temp, hard=True).type_as(x)
        else:
            x = hard_x.view(n * G, -1)
        x = x.view(n, -1).unsqueeze(-1) * self.vars
        return x.view(n, G, V, -1).sum(-2).view(n, -1), prob_ppl, code_ppl


class Wav2Vec2(nn.Module):
    def __init__(self, log_eps: float = 1e-7, logit_temp: float = 0.1):
        super().__init__()
        c = CONV[-1][0]
        self.feature_extractor = ConvFeatureExtractor()
        self.layer_norm = nn.LayerNorm(c)
        self.post_extract_proj = nn.Linear(c, EMBED)
        self.mask_emb = nn.Parameter(torch.FloatTensor(EMBED).uniform_())
        self.pos_conv = nn.Sequential(nn.Conv1d(EMBED, EMBED, 5, padding=2, groups=4),
                                      nn.GELU())
        layer = nn.TransformerEncoderLayer(EMBED, 4, 2 * EMBED, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.quantizer = GumbelVectorQuantizer(c, EMBED, log_eps=log_eps)
        self.project_q = nn.Linear(EMBED, EMBED)
        self.final_proj = nn.Linear(EMBED, EMBED)
        self.logit_temp = logit_temp

    def set_num_updates(self, n: int):
        self.quantizer.set_num_updates(n)

    def time_mask(self, padding_mask):
        """N_MASK frames of each utterance, drawn among its real (unpadded) frames."""
        scores = torch.rand(padding_mask.shape, device=padding_mask.device)
        scores = scores.masked_fill(padding_mask, -1.0)
        idx = scores.topk(N_MASK, dim=1).indices
        return torch.zeros_like(padding_mask).scatter_(1, idx, True)

    def sample_negatives(self, y):
        """fairseq's ``sample_negatives``: NEG distractors per target, from the other masked
        frames of the same utterance."""
        bsz, num, fsz = y.shape
        with torch.no_grad():
            tszs = torch.arange(num).unsqueeze(-1).expand(-1, NEG).flatten()
            neg_idxs = torch.randint(low=0, high=num - 1, size=(bsz, NEG * num))
            neg_idxs[neg_idxs >= tszs] += 1
            neg_idxs = neg_idxs + torch.arange(bsz).unsqueeze(1) * num
        negs = y.reshape(-1, fsz)[neg_idxs.view(-1)]
        return negs.view(bsz, num, NEG, fsz).permute(2, 0, 1, 3)  # (NEG, B, num, C)

    def compute_preds(self, x, y, negatives):
        neg_is_pos = (y == negatives).all(-1)
        targets = torch.cat([y.unsqueeze(0), negatives], dim=0)
        logits = torch.cosine_similarity(x.float(), targets.float(), dim=-1) / self.logit_temp
        if neg_is_pos.any():
            logits[1:][neg_is_pos] = float("-inf")
        return logits  # (1 + NEG, B, num)

    def forward(self, source, padding_mask):  # padding_mask: (B, T) True at padding
        features = self.feature_extractor(source).transpose(1, 2)
        features = self.layer_norm(features)
        unmasked = features.clone()
        lengths = feat_lengths((~padding_mask).sum(-1))
        pad = torch.arange(features.shape[1]).unsqueeze(0) >= lengths.unsqueeze(1)
        x = self.post_extract_proj(features)
        mask = self.time_mask(pad)
        x = torch.where(mask.unsqueeze(-1), self.mask_emb.to(x.dtype), x)
        x = x + self.pos_conv(x.transpose(1, 2)).transpose(1, 2)
        x = self.encoder(x, src_key_padding_mask=pad)
        b = x.shape[0]
        x = x[mask].view(b, N_MASK, -1)
        y, prob_ppl, code_ppl = self.quantizer(unmasked[mask])
        y = self.project_q(y).view(b, N_MASK, -1)
        negs = self.sample_negatives(y)
        logits = self.compute_preds(self.final_proj(x), y, negs)
        return logits, prob_ppl, code_ppl


def make_wav2vec2() -> nn.Module:
    torch.manual_seed(0)
    return Wav2Vec2()


def make_wav2vec2_no_log_eps() -> nn.Module:
    """The code perplexity logged as ``exp(-sum p log p)`` of the hard codes' counts, no eps."""
    torch.manual_seed(0)
    return Wav2Vec2(log_eps=0.0)


class Wav2Veccriterion(nn.Module):
    """fairseq's ``Wav2vecCriterion``: cross entropy with the true target first (class 0) over
    the (1 + NEG) candidates of every masked frame, plus the diversity loss
    ``(num_vars - prob_perplexity) / num_vars``; ``code_perplexity`` is only logged."""

    def __init__(self, num_vars: int = G * V, diversity_weight: float = 0.1,
                 label_smoothing: float = 0.0):
        super().__init__()
        self.num_vars = num_vars
        self.diversity_weight = diversity_weight
        self.label_smoothing = label_smoothing

    def forward(self, logits, prob_ppl, code_ppl):
        logits = logits.transpose(0, 2).reshape(-1, logits.size(0))
        target = logits.new_zeros(logits.size(0), dtype=torch.long)
        loss = F.cross_entropy(logits.float(), target, reduction="sum",
                               label_smoothing=self.label_smoothing)
        diversity = (self.num_vars - prob_ppl) / self.num_vars
        return loss / target.numel() + self.diversity_weight * diversity


class Utterances(Dataset):
    """Voiced-like clips of 480..800 samples (16 kHz); ``silent`` indices are digital silence,
    ``quiet`` ones a near-silent recording (a resampler's ringing around 1e-24)."""

    def __init__(self, n: int, silent: tuple = (), quiet: tuple = (), fixed: int | None = None):
        self.n, self.silent, self.quiet, self.fixed = n, silent, quiet, fixed

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(3000 + i)
        length = self.fixed or int(torch.randint(480, 801, (1,), generator=g))
        t = torch.arange(length) / 16000.0
        f0 = 100 + 200 * torch.rand(1, generator=g)
        wav = sum(torch.sin(2 * torch.pi * f0 * h * t) / h for h in (1, 2, 3)) * 0.3
        wav = wav + 0.01 * torch.randn(length, generator=g)
        if i in self.silent:
            wav = torch.zeros(length)
        if i in self.quiet:
            wav = 1e-24 * torch.randn(length, generator=g)
        return wav


def collate(items):
    """Zero-pads to the longest clip; the padding mask is True at padded samples."""
    lens = torch.tensor([len(w) for w in items])
    wav = torch.stack([F.pad(w, (0, int(lens.max()) - len(w))) for w in items])
    return wav, torch.arange(wav.shape[1]).unsqueeze(0) >= lens.unsqueeze(1)


# ---------------------------------------------------------------------------------------------
# EnCodec / SoundStream-style codec


class EMAVectorQuantizer(nn.Module):
    """A codebook trained by EMA of the assigned vectors (Laplace-smoothed counts), codes used
    less than ``threshold`` times replaced by random vectors of the batch."""

    def __init__(self, dim: int, size: int = 16, decay: float = 0.9, eps: float = 1e-5,
                 threshold: float = 0.5):
        super().__init__()
        self.decay, self.eps, self.threshold = decay, eps, threshold
        embed = torch.randn(size, dim)
        self.register_buffer("embed", embed)
        self.register_buffer("cluster_size", torch.ones(size))
        self.register_buffer("embed_avg", embed.clone())
        self.register_buffer("inited", torch.tensor(False))

    def forward(self, x):  # (N, dim)
        if self.training and not self.inited:  # (EnCodec's kmeans_init: codes from the data)
            with torch.no_grad():
                pick = torch.randperm(x.shape[0])[:len(self.embed)]
                self.embed.copy_(x[pick])
                self.embed_avg.copy_(x[pick])
                self.inited.fill_(True)
        dist = (x.pow(2).sum(1, keepdim=True) - 2 * x @ self.embed.t()
                + self.embed.pow(2).sum(1)[None])
        ind = dist.argmin(1)
        quantize = F.embedding(ind, self.embed)
        if self.training:
            with torch.no_grad():
                onehot = F.one_hot(ind, self.embed.shape[0]).type(x.dtype)
                self.cluster_size.mul_(self.decay).add_(onehot.sum(0), alpha=1 - self.decay)
                self.embed_avg.mul_(self.decay).add_(onehot.t() @ x, alpha=1 - self.decay)
                n = self.cluster_size.sum()
                size = (self.cluster_size + self.eps) / (n + len(self.embed) * self.eps) * n
                self.embed.copy_(self.embed_avg / size.unsqueeze(1))
                dead = self.cluster_size < self.threshold
                if dead.any():
                    pick = torch.randint(0, x.shape[0], (int(dead.sum()),))
                    self.embed[dead] = x[pick]
                    self.embed_avg[dead] = x[pick]
                    self.cluster_size[dead] = 1.0
        return quantize, ind


class ResidualVQ(nn.Module):
    def __init__(self, dim: int, n_q: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(EMAVectorQuantizer(dim) for _ in range(n_q))

    def forward(self, x):  # (B, D, T)
        flat = x.transpose(1, 2).reshape(-1, x.shape[1])
        residual, out, commit = flat, torch.zeros_like(flat), 0.0
        for layer in self.layers:
            q, _ = layer(residual.detach())
            commit = commit + F.mse_loss(residual, q.detach())
            out = out + q
            residual = residual - q.detach()
        out = flat + (out - flat).detach()  # straight-through
        return out.view(x.shape[0], x.shape[2], -1).transpose(1, 2), commit


class Codec(nn.Module):
    def __init__(self, ch: int = 16, dim: int = 16):
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Conv1d(1, ch, 7, padding=3), nn.ELU(),
            nn.Conv1d(ch, 2 * ch, 4, stride=2, padding=1), nn.ELU(),
            nn.Conv1d(2 * ch, 2 * ch, 4, stride=2, padding=1), nn.ELU(),
            nn.Conv1d(2 * ch, dim, 3, padding=1))
        self.quantizer = ResidualVQ(dim)
        self.decoder = nn.Sequential(
            nn.Conv1d(dim, 2 * ch, 3, padding=1), nn.ELU(),
            nn.ConvTranspose1d(2 * ch, 2 * ch, 4, stride=2, padding=1), nn.ELU(),
            nn.ConvTranspose1d(2 * ch, ch, 4, stride=2, padding=1), nn.ELU(),
            nn.Conv1d(ch, 1, 7, padding=3), nn.Tanh())

    def forward(self, wav):  # (B, T) -> (B, T), commitment loss
        z = self.encoder(wav.unsqueeze(1))
        q, commit = self.quantizer(z)
        return self.decoder(q).squeeze(1)[..., :wav.shape[-1]], commit


def make_codec() -> nn.Module:
    torch.manual_seed(0)
    return Codec()


class MultiScaleSTFTLoss(nn.Module):
    """Over several FFT sizes, the L1 of the magnitudes plus the L1 of their logs. EnCodec /
    auraloss style: ``stft(...).abs()`` clamped at ``floor``, the estimate's log first;
    ``power``: parallel_wavegan's ``sqrt(clamp(re² + im², floor))``, the target's log first
    (its ``LogSTFTMagnitudeLoss``). ``floor=None``: the clamp forgotten."""

    def __init__(self, scales=(64, 128), floor: float | None = 1e-7, power: bool = False):
        super().__init__()
        self.scales, self.floor, self.power = list(scales), floor, power

    def magnitude(self, x, n_fft):
        spec = torch.stft(x, n_fft, n_fft // 4, window=torch.hann_window(n_fft),
                          return_complex=True)
        if self.power:
            power = spec.real ** 2 + spec.imag ** 2
            return torch.sqrt(power.clamp(min=self.floor) if self.floor else power)
        mag = spec.abs()
        return mag.clamp(min=self.floor) if self.floor is not None else mag

    def forward(self, y_hat, y):
        loss = 0.0
        for n_fft in self.scales:
            s_hat, s = self.magnitude(y_hat, n_fft), self.magnitude(y, n_fft)
            if self.power:
                log_term = F.l1_loss(torch.log(s), torch.log(s_hat))
            else:
                log_term = F.l1_loss(torch.log(s_hat), torch.log(s))
            loss = loss + F.l1_loss(s_hat, s) + log_term
        return loss / len(self.scales)


class PeriodDiscriminator(nn.Module):
    def __init__(self, period: int):
        super().__init__()
        self.period = period
        self.convs = nn.ModuleList([nn.Conv2d(1, 8, (5, 1), (3, 1), padding=(2, 0)),
                                    nn.Conv2d(8, 16, (5, 1), (3, 1), padding=(2, 0))])
        self.post = nn.Conv2d(16, 1, (3, 1), padding=(1, 0))

    def forward(self, x):  # (B, T)
        b, t = x.shape
        if t % self.period:
            x = F.pad(x, (0, self.period - t % self.period), "reflect")
        x = x.view(b, 1, -1, self.period)
        for conv in self.convs:
            x = F.leaky_relu(conv(x), 0.1)
        return self.post(x).flatten(1)


class MultiPeriodDiscriminator(nn.Module):
    def __init__(self, periods=(2, 3, 5)):
        super().__init__()
        self.discriminators = nn.ModuleList(PeriodDiscriminator(p) for p in periods)

    def forward(self, x):
        return [d(x) for d in self.discriminators]


def make_mpd() -> nn.Module:
    torch.manual_seed(1)
    return MultiPeriodDiscriminator()


def d_lsgan(real, fake):
    return sum(torch.mean((1 - r) ** 2) + torch.mean(f ** 2) for r, f in zip(real, fake))


def g_lsgan(fake):
    return sum(torch.mean((1 - f) ** 2) for f in fake)
