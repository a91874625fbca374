"""E(3)-equivariant interatomic networks written in plain PyTorch as PaiNN, NequIP, DimeNet and
EGNN code writes them (``test_equivariant_networks.py``). Molecules are concatenated atom by
atom with a ``batch`` vector ``(N,)``; edges come from a radius graph over the positions;
features are scalars ``s (N, F)`` and vectors ``v (N, 3, F)``, passed along the edges with
``index_add``. PaiNN predicts forces as ``-dE/dpos`` with ``autograd.grad(create_graph=True)``
in its forward and trains on an energy-and-forces loss; the padded DimeNet-style model and
the dense EGNN train on QM9-style energies alone."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def radius_graph(pos: torch.Tensor, batch: torch.Tensor, cutoff: float):
    """torch_cluster's ``radius_graph`` without self-loops: pairs (j -> i) of one molecule
    closer than ``cutoff``."""
    with torch.no_grad():
        same = batch[:, None] == batch[None, :]
        near = (torch.cdist(pos, pos) < cutoff) & ~torch.eye(len(pos), dtype=torch.bool)
        i, j = torch.nonzero(same & near, as_tuple=True)
    return torch.stack([j, i])


def cosine_cutoff(d: torch.Tensor, cutoff: float) -> torch.Tensor:
    """Behler's smooth cosine cutoff, 0 beyond ``cutoff``."""
    return 0.5 * (torch.cos(d * math.pi / cutoff) + 1.0) * (d < cutoff)


def bump_cutoff(d: torch.Tensor, cutoff: float, safe: bool = False) -> torch.Tensor:
    """The smooth bump cutoff exp(-x^2 / (1 - x^2)), x = d / cutoff, 0 beyond the cutoff;
    ``safe``: the double where, x made 0 past the edge before the exp."""
    x = d / cutoff
    if safe:
        x = torch.where(x < 1, x, torch.zeros_like(x))
    return torch.where(x < 1, torch.exp(-x ** 2 / (1 - x ** 2)), 0.0)  # the bug: exp overflows just past 1


class GaussianRBF(nn.Module):
    def __init__(self, n: int, cutoff: float):
        super().__init__()
        self.register_buffer("offsets", torch.linspace(0, cutoff, n))
        self.coeff = -0.5 / (cutoff / (n - 1)) ** 2

    def forward(self, d):
        return torch.exp(self.coeff * (d[:, None] - self.offsets) ** 2)


class PaiNNMessage(nn.Module):
    """PaiNN's message block: a filter from the radial basis splits into the scalar message
    and the two vector messages (the neighbour's vectors, and the unit vector r_ij / |r_ij|)."""

    def __init__(self, f: int, n_rbf: int):
        super().__init__()
        self.f = f
        self.phi = nn.Sequential(nn.Linear(f, f), nn.SiLU(), nn.Linear(f, 3 * f))
        self.filter = nn.Linear(n_rbf, 3 * f)

    def forward(self, s, v, rbf, fcut, unit, edge_index):
        j, i = edge_index
        x = self.phi(s)[j] * self.filter(rbf) * fcut[:, None]
        ds, dvv, dvs = x.split(self.f, dim=-1)
        dv = v[j] * dvv[:, None, :] + dvs[:, None, :] * unit[:, :, None]
        return (s + torch.zeros_like(s).index_add(0, i, ds),
                v + torch.zeros_like(v).index_add(0, i, dv))


class PaiNNUpdate(nn.Module):
    """PaiNN's update block: the gate reads the norm of a linear map of each atom's vectors
    (schnetpack: ``torch.sqrt(torch.sum(mu_V ** 2, dim=-2) + self.epsilon)``)."""

    def __init__(self, f: int, eps: float | None, norm_activation: bool = False):
        super().__init__()
        self.f, self.eps, self.norm_activation = f, eps, norm_activation
        self.gate_bias = nn.Parameter(torch.zeros(f))
        self.U = nn.Linear(f, f, bias=False)
        self.V = nn.Linear(f, f, bias=False)
        self.mlp = nn.Sequential(nn.Linear(2 * f, f), nn.SiLU(), nn.Linear(f, 3 * f))

    def forward(self, s, v):
        uv, vv = self.U(v), self.V(v)
        if self.eps is None:  # (torch's norm: its gradient at 0 is 0, its second derivative NaN)
            vnorm = torch.linalg.vector_norm(vv, dim=-2)
        else:
            vnorm = torch.sqrt(torch.sum(vv ** 2, dim=-2) + self.eps)  # eps=0: the bug at v = 0
        a_vv, a_sv, a_ss = self.mlp(torch.cat([s, vnorm], -1)).split(self.f, dim=-1)
        v = v + a_vv[:, None, :] * uv
        if self.norm_activation:  # e3nn's NormActivation(normalize=True), epsilon None
            vn = torch.linalg.vector_norm(v, dim=-2, keepdim=True)
            v = v / vn * torch.sigmoid(vn + self.gate_bias)  # the bug: 0/0 at a zero vector
        return s + (uv * vv).sum(-2) * a_sv + a_ss, v


class PaiNN(nn.Module):
    """PaiNN (Schuett et al. 2021) with SchNetPack's energy and force heads."""

    def __init__(self, f: int = 16, n_rbf: int = 12, cutoff: float = 4.0, layers: int = 2,
                 eps: float | None = 1e-8, skin: float = 0.0, cutoff_fn: str = "cosine",
                 norm_activation: bool = False):
        super().__init__()
        self.cutoff, self.skin, self.cutoff_fn = cutoff, skin, cutoff_fn
        self.embedding = nn.Embedding(20, f)
        self.rbf = GaussianRBF(n_rbf, cutoff)
        self.messages = nn.ModuleList(PaiNNMessage(f, n_rbf) for _ in range(layers))
        self.updates = nn.ModuleList(PaiNNUpdate(f, eps, norm_activation) for _ in range(layers))
        self.readout = nn.Sequential(nn.Linear(f, f), nn.SiLU(), nn.Linear(f, 1))

    def forward(self, z, pos, batch, num_molecules: int):
        with torch.enable_grad():
            pos.requires_grad_(True)
            # (a Verlet list keeps pairs up to cutoff + skin, so it need not be rebuilt often)
            edge_index = radius_graph(pos, batch, self.cutoff + self.skin)
            j, i = edge_index
            vec = pos[j] - pos[i]
            d = torch.linalg.vector_norm(vec, dim=-1)
            unit = vec / d[:, None]
            rbf = self.rbf(d)
            if self.cutoff_fn == "cosine":
                fcut = cosine_cutoff(d, self.cutoff)
            else:
                fcut = bump_cutoff(d, self.cutoff, safe=self.cutoff_fn == "bump_safe")
            s = self.embedding(z)
            v = torch.zeros(len(z), 3, s.shape[1], dtype=s.dtype)  # vectors start at 0
            for message, update in zip(self.messages, self.updates):
                s, v = message(s, v, rbf, fcut, unit, edge_index)
                s, v = update(s, v)
            e_atom = self.readout(s).squeeze(-1)
            energy = torch.zeros(num_molecules, dtype=pos.dtype).index_add(0, batch, e_atom)
            forces = -torch.autograd.grad(energy.sum(), pos, create_graph=self.training)[0]
        return energy, forces


def make_painn(**kw) -> PaiNN:
    torch.manual_seed(0)
    return PaiNN(**kw)


def make_painn_no_eps() -> PaiNN:
    return make_painn(eps=0.0)


def make_painn_vector_norm() -> PaiNN:
    return make_painn(eps=None)


def make_painn_norm_activation() -> PaiNN:
    return make_painn(norm_activation=True)


def make_painn_bump() -> PaiNN:
    return make_painn(skin=1.0, cutoff_fn="bump")


def make_painn_bump_safe() -> PaiNN:
    return make_painn(skin=1.0, cutoff_fn="bump_safe")


class EnergyForceLoss(nn.Module):
    """NequIP's / SchNetPack's per-atom energy and force MSE, forces weighted up."""

    def __init__(self, energy_weight: float = 0.05, force_weight: float = 0.95):
        super().__init__()
        self.energy_weight, self.force_weight = energy_weight, force_weight

    def forward(self, out, energy, forces, n_atoms):
        e, f = out
        return (self.energy_weight * F.mse_loss(e / n_atoms, energy / n_atoms)
                + self.force_weight * F.mse_loss(f, forces))


class BesselBasis(nn.Module):
    """DimeNet's radial Bessel basis sqrt(2/c) sin(n pi d / c) / d with learned frequencies;
    at d = 0 (a padded neighbour) the ``torch.where`` gives its limit n pi / c."""

    def __init__(self, n: int, cutoff: float, safe: bool = False):
        super().__init__()
        self.cutoff, self.safe = cutoff, safe
        self.freq = nn.Parameter(torch.arange(1, n + 1, dtype=torch.float32) * math.pi)

    def forward(self, d):
        x = d[..., None]
        if self.safe:  # the double-where fix: a safe divisor before the division
            x = torch.where(x > 0, x, torch.ones_like(x))
        rbf = torch.sin(self.freq * x / self.cutoff) / x  # the bug: the where below hides 0/0
        return math.sqrt(2 / self.cutoff) * torch.where(x > 0, rbf, self.freq / self.cutoff)


class PaddedInteraction(nn.Module):
    """SchNet's interaction over schnetpack 1.x's padded neighbour lists ``(B, A, K)``."""

    def __init__(self, f: int, n_rbf: int, attention: bool = False, keep_one: bool = False):
        super().__init__()
        self.keep_one = keep_one
        self.filter = nn.Sequential(nn.Linear(n_rbf, f), nn.SiLU(), nn.Linear(f, f))
        self.lin = nn.Linear(f, f)
        self.out = nn.Sequential(nn.SiLU(), nn.Linear(f, f))
        self.score = nn.Linear(f, 1) if attention else None

    def forward(self, h, rbf, fcut, neighbors, neighbor_mask):
        b, a, k = neighbors.shape
        hj = torch.gather(self.lin(h), 1, neighbors.reshape(b, a * k, 1).expand(-1, -1, h.shape[-1]))
        w = self.filter(rbf) * (fcut * neighbor_mask)[..., None]
        msg = hj.view(b, a, k, -1) * w
        if self.score is None:
            return h + self.out(msg.sum(2))
        # an equivariant transformer's attention over the neighbours, padding masked to -inf
        allowed = neighbor_mask > 0
        if self.keep_one:  # (the fix: a padding atom attends to its first slot, a zero message)
            allowed = allowed | ~allowed.any(-1, keepdim=True) & (torch.arange(k) == 0)
        logits = self.score(msg).squeeze(-1).masked_fill(~allowed, float("-inf"))
        return h + self.out((logits.softmax(-1)[..., None] * msg).sum(2))


class PaddedDimeNet(nn.Module):
    """A QM9 energy model on padded molecules (schnetpack 1.x's batches: ``pos (B, A, 3)``,
    the neighbour indices ``(B, A, K)`` padded with 0 under a ``neighbor_mask``), with
    DimeNet's Bessel basis; distances of padded pairs set to 0 as schnetpack's
    ``atom_distances`` does."""

    def __init__(self, f: int = 16, n_rbf: int = 8, cutoff: float = 5.0, blocks: int = 2,
                 safe: bool = False, attention: bool = False, keep_one: bool = False):
        super().__init__()
        self.cutoff = cutoff
        self.embedding = nn.Embedding(20, f, padding_idx=0)
        self.rbf = BesselBasis(n_rbf, cutoff, safe)
        self.blocks = nn.ModuleList(PaddedInteraction(f, n_rbf, attention, keep_one)
                                    for _ in range(blocks))
        self.readout = nn.Sequential(nn.Linear(f, f), nn.SiLU(), nn.Linear(f, 1))

    def forward(self, z, pos, neighbors, neighbor_mask, atom_mask):
        b, a, k = neighbors.shape
        pos_j = torch.gather(pos, 1, neighbors.reshape(b, a * k, 1).expand(-1, -1, 3))
        vec = pos_j.view(b, a, k, 3) - pos[:, :, None]
        d = torch.where(neighbor_mask > 0, torch.linalg.vector_norm(vec, dim=-1), 0.0)
        rbf, fcut = self.rbf(d), cosine_cutoff(d, self.cutoff)
        h = self.embedding(z)
        for block in self.blocks:
            h = block(h, rbf, fcut, neighbors, neighbor_mask)
        return (self.readout(h).squeeze(-1) * atom_mask).sum(1)


def make_padded(safe: bool = False, attention: bool = False, keep_one: bool = False
                ) -> PaddedDimeNet:
    torch.manual_seed(0)
    return PaddedDimeNet(safe=safe, attention=attention, keep_one=keep_one)


def make_padded_attention() -> PaddedDimeNet:
    return make_padded(safe=True, attention=True)


def make_padded_attention_kept() -> PaddedDimeNet:
    return make_padded(safe=True, attention=True, keep_one=True)


def make_padded_safe() -> PaddedDimeNet:
    return make_padded(safe=True)


def padded_collate(mols):
    """schnetpack 1.x's ``collate_aseatoms``: molecules padded to the batch's largest, every
    other atom its neighbour, the neighbour list padded with index 0 under the mask."""
    a = max(len(z) for z, *_ in mols)
    z = torch.zeros(len(mols), a, dtype=torch.long)
    pos = torch.zeros(len(mols), a, 3)
    nbh = torch.zeros(len(mols), a, a - 1, dtype=torch.long)
    nmask = torch.zeros(len(mols), a, a - 1)
    for m, (zm, pm, *_) in enumerate(mols):
        n = len(zm)
        z[m, :n], pos[m, :n] = zm, pm
        for i in range(n):
            others = torch.tensor([j for j in range(n) if j != i], dtype=torch.long)
            nbh[m, i, :n - 1], nmask[m, i, :n - 1] = others, 1.0
    energy = torch.stack([e for _, _, e, _ in mols])
    return z, pos, nbh, nmask, (z > 0).float(), energy


class DenseEGNNLayer(nn.Module):
    """EGNN's (Satorras et al. 2021) invariant update over all pairs of a padded batch: the
    edge MLP reads both atoms' features and their squared distance."""

    def __init__(self, f: int):
        super().__init__()
        self.edge = nn.Sequential(nn.Linear(2 * f + 1, f), nn.SiLU(), nn.Linear(f, f), nn.SiLU())
        self.node = nn.Sequential(nn.Linear(2 * f, f), nn.SiLU(), nn.Linear(f, f))

    def forward(self, h, d, pair_mask):
        b, a, f = h.shape
        pairs = torch.cat([h[:, :, None].expand(b, a, a, f), h[:, None].expand(b, a, a, f),
                           d[..., None]], -1)
        m = (self.edge(pairs) * pair_mask[..., None]).sum(2)
        return h + self.node(torch.cat([h, m], -1))


class DenseEGNN(nn.Module):
    """A dense EGNN energy model trained under bfloat16 autocast; the pair distances from
    the Gram matrix, |x_i|^2 + |x_j|^2 - 2 x_i . x_j, as torch.cdist's matmul path does."""

    def __init__(self, f: int = 16, layers: int = 2, gram: bool = True):
        super().__init__()
        self.gram = gram
        self.embedding = nn.Embedding(20, f, padding_idx=0)
        self.layers = nn.ModuleList(DenseEGNNLayer(f) for _ in range(layers))
        self.readout = nn.Sequential(nn.Linear(f, f), nn.SiLU(), nn.Linear(f, 1))

    def forward(self, z, pos, atom_mask):
        if self.gram:
            sq = (pos ** 2).sum(-1)
            d2 = sq[:, :, None] + sq[:, None, :] - 2 * pos @ pos.transpose(1, 2)
            d = torch.sqrt(d2)  # the bug: rounding makes d2 of an atom with itself negative
        else:  # (the fix: the differences' norm, 0 with a gradient of 0 on the diagonal)
            d = torch.linalg.vector_norm(pos[:, :, None] - pos[:, None], dim=-1)
        eye = torch.eye(pos.shape[1], dtype=torch.bool)
        pair_mask = atom_mask[:, :, None] * atom_mask[:, None, :] * ~eye
        h = self.embedding(z)
        for layer in self.layers:
            h = layer(h, d, pair_mask)
        return (self.readout(h).squeeze(-1) * atom_mask).sum(1)


def make_egnn(gram: bool = True) -> DenseEGNN:
    torch.manual_seed(0)
    return DenseEGNN(gram=gram)


def make_egnn_differences() -> DenseEGNN:
    return make_egnn(gram=False)


# ---------------------------------------------------------------------------------------------
# data


def molecule(g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random molecule of ``n`` atoms about a bond length apart (Angstrom)."""
    z = torch.tensor([6, 7, 8, 1])[torch.randint(0, 4, (n,), generator=g)]
    offsets = torch.randn(n, 3, generator=g) * 0.6
    pos = torch.cumsum(offsets + torch.tensor([0.9, 0.0, 0.0]), 0)
    return z, pos - pos.mean(0)


def reference(z: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels from a Morse pair potential: the energy (eV) and forces (eV / Angstrom)."""
    p = pos.detach().clone().requires_grad_(True)
    d = (p[:, None] - p[None]).pow(2).sum(-1).add(torch.eye(len(p))).sqrt()
    off = 1 - torch.eye(len(p))
    e = 0.5 * ((1 - torch.exp(-(d - 1.5))) ** 2 * off).sum()
    (grad,) = torch.autograd.grad(e, p)
    return e.detach(), -grad


def with_counterion(z: torch.Tensor, pos: torch.Tensor, far: float = 9.0):
    """A sodium counter-ion of a salt's xyz frame, placed ``far`` Angstrom from the molecule:
    beyond the cutoff of every atom, so the radius graph gives it no edge."""
    ion = pos.mean(0) + torch.tensor([far, 0.0, 0.0])
    return torch.cat([z, torch.tensor([11])]), torch.cat([pos, ion[None]])


def with_shell_atom(z: torch.Tensor, pos: torch.Tensor, at: float = 4.012):
    """A hydrogen ``at`` Angstrom from atom 0, away from the molecule's centre: just past the
    4 Angstrom cutoff, within the Verlet list's skin."""
    away = pos[0] - pos.mean(0)
    h = pos[0] + at * away / away.norm()
    return torch.cat([z, torch.tensor([1])]), torch.cat([pos, h[None]])


def collate(mols):
    """PyG's ``Batch.from_data_list``: atoms concatenated, the batch vector, one energy per
    molecule, one force per atom, and each molecule's atom count."""
    z, pos, e, f = zip(*mols)
    batch = torch.cat([torch.full((len(a),), k) for k, a in enumerate(z)])
    n_atoms = torch.tensor([len(a) for a in z], dtype=torch.float32)
    return torch.cat(z), torch.cat(pos), batch, torch.stack(e), torch.cat(f), n_atoms


def batches(bad: int | None, steps: int = 4, molecules: int = 6, plant_at: int = 3,
            collate=collate, plant=with_counterion):
    """Collated batches of random molecules; at step ``plant_at`` molecule ``bad`` (if any)
    is changed by ``plant`` (by default, it comes with its counter-ion)."""
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        data = []
        for k in range(molecules):
            z, pos = molecule(g, int(torch.randint(3, 7, (1,), generator=g)))
            if step == plant_at and k == bad:
                z, pos = plant(z, pos)
            e, f = reference(z, pos)
            data.append((z, pos, e, f))
        yield collate(data)
