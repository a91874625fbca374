"""Hypernetworks and the regularizers written with ``torch.func``, as their public repositories
write them; the factories of ``test_hypernetworks.py``.

- ``SirenHyperNet``: vsitzmann/siren's ``meta_modules.py``: a ``SetEncoder`` pools the context
  points into a latent (its masked mean ``embeddings.mean(-2) * (n / ctxt_mask.sum(-2))``), a
  ``HyperNetwork`` makes every parameter of the SIREN per sample, and ``BatchLinear`` runs the
  SIREN with them (``input.matmul(weight.transpose(-1, -2))``, a batched product).
- ``SNCritic``: christiancosgrove/pytorch-spectral-normalization-gan's hand-written
  ``SpectralNorm`` (one power iteration per forward on ``u``/``v`` written through ``.data``,
  ``w / sigma``) around the layers of a critic whose last layer is zero-initialised (the
  ``zero_module`` trick of openai/guided-diffusion); ``buffers=True`` keeps ``u``/``v`` in
  buffers (as torch's ``spectral_norm`` and ajbrock/BigGAN-PyTorch do), ``u_zero=True``
  starts one ``u`` at zeros.
- ``CondHyperNet``: chrhenning/hypnettorch's ``HMLP`` (von Oswald et al., "Continual learning
  with hypernetworks"), conditioned per sample: a condition -> every weight of the main
  network, which runs each sample with its own weights by
  ``torch.vmap(torch.func.functional_call)``.
- ``FiLMNet``: ethanjperez/film's FiLM (``gammas * x + betas``) conditioned on an instruction
  embedded by a masked mean over its tokens.
- ``ContractiveAE``: a contractive autoencoder whose Jacobian penalty (the encoder's Jacobian
  per sample by ``torch.func.vmap(torch.func.jacrev(...))``, as PyTorch's per-sample Jacobian
  recipe writes it) is taken in its forward, or in the loss given the model
  (``cae_model_loss``); ``radial=True`` gives the encoder the record's norm as a feature.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jacrev, vmap

# ---------------------------------------------------------------------------------------------
# SIREN hypernetwork (vsitzmann/siren meta_modules.py, modules.py)


class BatchLinear(nn.Linear):
    """siren's ``BatchLinear``: a linear layer that takes its weights per sample."""

    def forward(self, input, params):
        weight, bias = params["weight"], params["bias"]
        output = input.matmul(weight.permute(*range(weight.dim() - 2), -1, -2))
        return output + bias.unsqueeze(-2)


class Sine(nn.Module):
    def forward(self, input):
        return torch.sin(30 * input)


class Siren(nn.Module):
    """The hypo-network: coordinates (B, N, 2) -> values (B, N, 1); no weights of its own used."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.net = nn.ModuleList([BatchLinear(2, hidden), BatchLinear(hidden, hidden),
                                  BatchLinear(hidden, 1)])
        self.act = Sine()

    def forward(self, coords, params):
        x = coords
        for i, layer in enumerate(self.net):
            sub = {k.split(".", 2)[2]: v for k, v in params.items()
                   if k.startswith(f"net.{i}.")}
            x = layer(x, sub)
            if i < len(self.net) - 1:
                x = self.act(x)
        return x


class SetEncoder(nn.Module):
    def __init__(self, in_features: int = 3, latent: int = 16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_features, latent), nn.ReLU(),
                                 nn.Linear(latent, latent))

    def forward(self, context_x, context_y, ctxt_mask):
        embeddings = self.net(torch.cat((context_x, context_y), dim=-1))
        embeddings = embeddings * ctxt_mask
        # (siren's own line: a context set with no point has sum 0)
        return embeddings.mean(dim=-2) * (embeddings.shape[-2] / torch.sum(ctxt_mask, dim=-2))


class HyperNetwork(nn.Module):
    """One small MLP per parameter of the hypo-network, as siren's ``HyperNetwork``."""

    def __init__(self, latent: int, hypo: nn.Module):
        super().__init__()
        self.names, self.shapes = [], []
        self.nets = nn.ModuleList()
        for name, p in hypo.named_parameters():
            self.names.append(name)
            self.shapes.append(p.shape)
            net = nn.Sequential(nn.Linear(latent, 32), nn.ReLU(), nn.Linear(32, p.numel()))
            with torch.no_grad():  # siren's hyper_weight_init: the last layer scaled down
                net[-1].weight /= 1e2
            self.nets.append(net)

    def forward(self, z):
        return {n: net(z).reshape((-1,) + tuple(s))
                for n, s, net in zip(self.names, self.shapes, self.nets)}


class SirenHyperNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.hypo_net = Siren()
        self.encoder = SetEncoder()
        self.hyper_net = HyperNetwork(16, self.hypo_net)

    def forward(self, context_x, context_y, ctxt_mask, query_x):
        z = self.encoder(context_x, context_y, ctxt_mask)
        params = self.hyper_net(z)
        return self.hypo_net(query_x, params), z, params


def make_siren_hyper():
    torch.manual_seed(0)
    return SirenHyperNet()


def siren_loss(out, query_y):
    """siren's ``hypo_weight_loss`` and ``latent_loss`` beside the image MSE."""
    pred, z, params = out
    weights = sum(p.pow(2).mean() for p in params.values())
    return F.mse_loss(pred, query_y) + 1e-1 * z.pow(2).mean() + 1e2 * weights


def siren_batch(g, n_ctx: int = 12, n_query: int = 16, batch: int = 6, empty=()):
    """Images as functions (B, N, 2) -> (B, N, 1); ``empty``: the samples with no context point
    (every one masked out)."""
    freq = torch.rand(batch, 1, 2, generator=g) * 3
    cx = torch.rand(batch, n_ctx, 2, generator=g) * 2 - 1
    qx = torch.rand(batch, n_query, 2, generator=g) * 2 - 1
    cy = torch.sin((cx * freq).sum(-1, keepdim=True))
    qy = torch.sin((qx * freq).sum(-1, keepdim=True))
    mask = (torch.rand(batch, n_ctx, 1, generator=g) < 0.7).float()
    mask[:, 0] = 1.0
    for i in empty:
        mask[i] = 0.0
    return cx, cy, mask, qx, qy


# ---------------------------------------------------------------------------------------------
# hand-written spectral norm (christiancosgrove/pytorch-spectral-normalization-gan)


def l2normalize(v, eps=1e-12):
    return v / (v.norm() + eps)


class SpectralNorm(nn.Module):
    """``buffers``: u and v kept in buffers (as torch's spectral_norm and BigGAN-PyTorch keep
    them), not in parameters without gradient."""

    def __init__(self, module, name="weight", power_iterations=1, buffers=False,
                 u_zero=False):
        super().__init__()
        self.module, self.name, self.power_iterations = module, name, power_iterations
        w = getattr(self.module, self.name)
        height = w.data.shape[0]
        width = w.view(height, -1).data.shape[1]
        u = nn.Parameter(w.data.new(height).normal_(0, 1), requires_grad=False)
        if u_zero:  # (the bug: u started at zeros, not at a random unit vector)
            u.data.zero_()
        v = nn.Parameter(w.data.new(width).normal_(0, 1), requires_grad=False)
        u.data = l2normalize(u.data)
        v.data = l2normalize(v.data)
        w_bar = nn.Parameter(w.data)
        del self.module._parameters[self.name]
        keep = self.module.register_buffer if buffers else self.module.register_parameter
        keep(self.name + "_u", u.data if buffers else u)
        keep(self.name + "_v", v.data if buffers else v)
        self.module.register_parameter(self.name + "_bar", w_bar)

    def _update_u_v(self):
        u = getattr(self.module, self.name + "_u")
        v = getattr(self.module, self.name + "_v")
        w = getattr(self.module, self.name + "_bar")
        height = w.data.shape[0]
        for _ in range(self.power_iterations):
            v.data = l2normalize(torch.mv(torch.t(w.view(height, -1).data), u.data))
            u.data = l2normalize(torch.mv(w.view(height, -1).data, v.data))
        sigma = u.dot(w.view(height, -1).mv(v))
        setattr(self.module, self.name, w / sigma.expand_as(w))

    def forward(self, *args):
        self._update_u_v()
        return self.module.forward(*args)


class SNCritic(nn.Module):
    def __init__(self, d_in: int = 8, hidden: int = 32, zero_last: bool = True,
                 buffers: bool = False, u_zero: bool = False):
        super().__init__()
        last = nn.Linear(hidden, 1)
        if zero_last:  # guided-diffusion's zero_module: start the residual output at 0
            nn.init.zeros_(last.weight)
            nn.init.zeros_(last.bias)
        self.body = nn.Sequential(SpectralNorm(nn.Linear(d_in, hidden), buffers=buffers),
                                  nn.LeakyReLU(0.1),
                                  SpectralNorm(nn.Linear(hidden, hidden), buffers=buffers,
                                               u_zero=u_zero),
                                  nn.LeakyReLU(0.1))
        self.head = SpectralNorm(last, buffers=buffers)

    def forward(self, x):
        return self.head(self.body(x)).squeeze(-1)


def make_sn_critic(zero_last: bool = True, buffers: bool = False, u_zero: bool = False):
    torch.manual_seed(0)
    return SNCritic(zero_last=zero_last, buffers=buffers, u_zero=u_zero)


def hinge_loss(scores, labels):
    """The critic's hinge loss: labels +1 (real) / -1 (fake)."""
    return F.relu(1.0 - labels * scores).mean()


# ---------------------------------------------------------------------------------------------
# hypnettorch: a conditional hypernetwork, its weights per sample, run by vmap(functional_call)


class MainNet(nn.Module):
    """The main network, a Gaussian regressor; it holds no weights of its own (built on the
    meta device, as PyTorch's model-ensembling recipe builds its stateless base): every call
    takes the generated ones."""

    def __init__(self, d_in: int = 4, hidden: int = 16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_in, hidden), nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, 2)

    def forward(self, x):
        h = F.elu(self.fc2(F.elu(self.fc1(x))))
        mean, log_var = self.head(h).unbind(-1)
        return torch.stack([mean, torch.exp(log_var)], -1)


class HMLP(nn.Module):
    """hypnettorch's ``HMLP``: a condition -> hidden layers -> one head per target shape (each
    sample's condition its own weights)."""

    def __init__(self, target_shapes: dict, d_cond: int = 2, hidden: int = 32):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_cond, hidden), nn.ReLU(),
                                  nn.Linear(hidden, hidden), nn.ReLU())
        self.shapes = target_shapes
        self.heads = nn.ModuleDict({n.replace(".", "_"): nn.Linear(hidden, math.prod(s))
                                    for n, s in target_shapes.items()})

    def forward(self, cond):
        h = self.body(cond)
        return {n: self.heads[n.replace(".", "_")](h).view(-1, *s)
                for n, s in self.shapes.items()}


class CondHyperNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.target = MainNet().to("meta")
        self.hnet = HMLP({n: p.shape for n, p in self.target.named_parameters()})

    def forward(self, x, cond):
        """``cond``: one per sample (B, d), or the task's (d,), whose weights every sample
        shares."""
        weights = self.hnet(cond)
        if cond.dim() == 1:
            return functional_call(self.target, {n: w[0] for n, w in weights.items()}, (x,))

        def one(w, xi):
            return functional_call(self.target, w, (xi,))
        return vmap(one)(weights, x)


def make_cond_hyper():
    torch.manual_seed(0)
    return CondHyperNet()


def gaussian_nll(out, y):
    mean, var = out.unbind(-1)
    return F.gaussian_nll_loss(mean, y, var)


# ---------------------------------------------------------------------------------------------
# FiLM (ethanjperez/film) conditioned on an instruction


class FiLMGen(nn.Module):
    def __init__(self, vocab: int = 20, emb: int = 16, channels: int = 8, blocks: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, emb, padding_idx=0)
        self.proj = nn.Linear(emb, 2 * channels * blocks)
        self.channels, self.blocks = channels, blocks

    def forward(self, tokens):
        mask = (tokens != 0).float().unsqueeze(-1)
        # masked mean over the instruction's tokens (the bug: an empty instruction has 0)
        h = (self.embed(tokens) * mask).sum(1) / mask.sum(1)
        return self.proj(h).view(-1, self.blocks, 2, self.channels)


class FiLM(nn.Module):
    def forward(self, x, gammas, betas):
        gammas = gammas.unsqueeze(2).unsqueeze(3).expand_as(x)
        betas = betas.unsqueeze(2).unsqueeze(3).expand_as(x)
        return (gammas * x) + betas


class FiLMedResBlock(nn.Module):
    def __init__(self, channels: int = 8):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(channels, affine=False)
        self.film = FiLM()

    def forward(self, x, gammas, betas):
        x = F.relu(self.conv1(x))
        out = F.relu(self.film(self.bn2(self.conv2(x)), gammas, betas))
        return x + out


class FiLMNet(nn.Module):
    def __init__(self, channels: int = 8, classes: int = 5):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.film_gen = FiLMGen(channels=channels)
        self.blocks = nn.ModuleList(FiLMedResBlock(channels) for _ in range(2))
        self.classifier = nn.Linear(channels, classes)

    def forward(self, image, tokens):
        film = self.film_gen(tokens)
        x = F.relu(self.stem(image))
        for i, block in enumerate(self.blocks):
            x = block(x, film[:, i, 0], film[:, i, 1])
        return self.classifier(x.mean((2, 3)))


def make_film():
    torch.manual_seed(0)
    return FiLMNet()


# ---------------------------------------------------------------------------------------------
# contractive autoencoder, its Jacobian penalty by torch.func


class Radial(nn.Module):
    """The record's norm appended to its features (a distance feature), without an eps: its
    derivative x / |x| is 0/0 at a record of zeros."""

    def forward(self, x):
        return torch.cat([x, torch.sqrt((x ** 2).sum(-1, keepdim=True))], -1)


class ContractiveAE(nn.Module):
    """``in_forward``: the forward takes the penalty and returns it beside the reconstruction;
    else it returns the reconstruction, and the loss takes the penalty (``cae_model_loss``).
    ``radial``: the encoder takes the record's norm as one more feature."""

    def __init__(self, d: int = 10, hidden: int = 6, in_forward: bool = True,
                 radial: bool = False):
        super().__init__()
        self.enc = nn.Sequential(Radial(), nn.Linear(d + 1, hidden), nn.Tanh()) if radial \
            else nn.Sequential(nn.Linear(d, hidden), nn.Tanh())
        self.dec = nn.Linear(hidden, d)
        self.in_forward = in_forward

    def forward(self, x, keep):
        h = self.enc(x * keep)  # the features the record has (a masked autoencoder's input)
        if not self.in_forward:
            return self.dec(h)
        jac = vmap(jacrev(lambda xi, ki: self.enc(xi * ki)))(x, keep)  # (B, hidden, d)
        # ||J||_F per record, the sqrt without an eps
        penalty = torch.sqrt(jac.pow(2).sum((1, 2)))
        return self.dec(h), penalty


def make_cae(in_forward: bool = True, radial: bool = False):
    torch.manual_seed(0)
    return ContractiveAE(in_forward=in_forward, radial=radial)


def cae_loss(out, x, lam: float = 1e-2):
    recon, penalty = out
    return F.mse_loss(recon, x) + lam * penalty.mean()


def cae_model_loss(recon, x, keep, model, lam: float = 1e-2):
    """The same penalty taken in the loss, given the model (its encoder's Jacobian there)."""
    jac = vmap(jacrev(lambda xi, ki: model.enc(xi * ki)))(x, keep)
    penalty = torch.sqrt(jac.pow(2).sum((1, 2)))  # (as in the forward: no eps)
    return F.mse_loss(recon, x) + lam * penalty.mean()
