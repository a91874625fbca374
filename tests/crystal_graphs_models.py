"""Materials property prediction on crystal graphs as CGCNN, MEGNet and ALIGNN write it, in
plain PyTorch (``test_crystal_graphs.py``). A crystal is its lattice ``(3, 3)``, fractional
coordinates ``(n, 3)`` and atomic numbers ``(n,)``; the data pipeline builds its neighbour list
by the minimum-image convention inside a cutoff radius and the bond lengths. A ``DataLoader``'s
``collate_fn`` joins the crystals of a batch into one big graph: atomic numbers ``z (N,)``,
site descriptors ``site (N, 2)`` (Pauling electronegativity, covalent radius in Angstrom,
standardised), the edges ``edge_index (2, E)`` offset by the atoms before them, bond lengths
``dist (E,)``, the ``batch`` vector ``(N,)``, ``n_atoms (G,)`` and the targets ``y (G, 2)``:
formation energy (eV/atom) and log10 of the bulk modulus K_VRH (GPa). The model embeds the
atoms, expands each bond length in Gaussians exp(-(d - mu)^2 / gamma^2), runs CGCNN's gated
convolutions sigmoid(z) * softplus(z) summed (or averaged) over the incoming edges with
``index_add_``, pools each crystal's atoms by a mean over the batch vector (or MEGNet's
attention weights) and predicts both targets, standardised by the training set's mean and std
which the loss, an L1 over the standardised targets, holds."""

from __future__ import annotations

import math

import torch
from torch import nn

CUTOFF = 6.0
# (Pauling electronegativity, covalent radius in Angstrom) of the elements the crystals hold
ELEMENTS = {3: (0.98, 1.28), 8: (3.44, 0.66), 12: (1.31, 1.41), 13: (1.61, 1.21),
            14: (1.90, 1.11), 22: (1.54, 1.60), 26: (1.83, 1.32), 29: (1.90, 1.32)}
SITE_MEAN, SITE_STD = torch.tensor([1.82, 1.24]), torch.tensor([0.70, 0.27])


class GaussianDistance(nn.Module):
    """CGCNN's Gaussian expansion of a bond length, centres from dmin to dmax every ``step``,
    width ``var``; ``normalise`` makes each bond's expansion sum to 1 (a soft one-hot)."""

    def __init__(self, dmin: float = 0.0, dmax: float = CUTOFF, step: float = 0.2,
                 var: float | None = None, normalise: bool = False):
        super().__init__()
        self.register_buffer("filter", torch.arange(dmin, dmax + step, step))
        self.var, self.normalise = var or step, normalise

    def forward(self, dist):
        rbf = torch.exp(-(dist[:, None] - self.filter) ** 2 / self.var ** 2)
        if self.normalise:
            return rbf / rbf.sum(-1, keepdim=True)
        return rbf


class BondAngles(nn.Module):
    """ALIGNN's line graph, small: the angle between two bonds of one centre atom (a triplet of
    the bond vectors ``vec``), acos of their cosine, expanded in Gaussians over [0, pi] and
    summed onto the triplet's first bond's features."""

    def __init__(self, nbr_fea_len: int, n: int = 8):
        super().__init__()
        self.register_buffer("centres", torch.linspace(0.0, math.pi, n))
        self.proj = nn.Linear(n, nbr_fea_len)

    def forward(self, vec, triplets, edge_fea):
        v1, v2 = vec[triplets[0]], vec[triplets[1]]
        cos = (v1 * v2).sum(-1) / (v1.norm(dim=-1) * v2.norm(dim=-1))
        theta = torch.acos(cos)  # the bug: no clamp to [-1, 1] (ALIGNN clamps the cosine)
        a = torch.exp(-(theta[:, None] - self.centres) ** 2 / 0.4 ** 2)
        return edge_fea + torch.zeros_like(edge_fea).index_add_(0, triplets[0], self.proj(a))


class ConvLayer(nn.Module):
    """CGCNN's gated convolution: z = W [h_i, h_j, e_ij], message sigmoid(z_f) * softplus(z_c)
    summed over the incoming edges with index_add_ (``aggregate="mean"``: divided by each
    atom's number of neighbours, ALIGNN's edge-gated mean), batch-normalised, residual."""

    def __init__(self, atom_fea_len: int, nbr_fea_len: int, aggregate: str = "sum",
                 where_guard: bool = False):
        super().__init__()
        self.fc_full = nn.Linear(2 * atom_fea_len + nbr_fea_len, 2 * atom_fea_len)
        self.bn1 = nn.BatchNorm1d(2 * atom_fea_len)
        self.bn2 = nn.BatchNorm1d(atom_fea_len)
        self.aggregate, self.where_guard = aggregate, where_guard

    def forward(self, h, edge_index, edge_fea):
        src, dst = edge_index
        z = self.bn1(self.fc_full(torch.cat([h[dst], h[src], edge_fea], dim=1)))
        nbr_filter, nbr_core = z.chunk(2, dim=1)
        msg = torch.sigmoid(nbr_filter) * nn.functional.softplus(nbr_core)
        agg = torch.zeros_like(h).index_add_(0, dst, msg)
        if self.aggregate == "mean":
            deg = torch.zeros(len(h), 1, dtype=h.dtype).index_add_(
                0, dst, torch.ones(len(dst), 1, dtype=h.dtype))
            if self.where_guard:  # "an atom with no neighbour keeps 0": the backward still divides
                agg = torch.where(deg > 0, agg / deg, torch.zeros_like(agg))
            else:
                agg = agg / deg
        return nn.functional.softplus(h + self.bn2(agg))


class AttentionPool(nn.Module):
    """MEGNet-style attention readout over each crystal's atoms, softmax over the batch vector
    written by hand: exp(score) / the crystal's sum of exp(score) (no max subtracted)."""

    def __init__(self, fea_len: int):
        super().__init__()
        self.gate = nn.Linear(fea_len, 1)

    def forward(self, h, batch, n_atoms):
        w = torch.exp(self.gate(h))
        denom = torch.zeros(len(n_atoms), 1, dtype=h.dtype).index_add_(0, batch, w)
        alpha = w / denom[batch]
        return torch.zeros(len(n_atoms), h.shape[1], dtype=h.dtype).index_add_(0, batch, alpha * h)


class MeanPool(nn.Module):
    """Each crystal's mean of its atoms' features: a sum over the batch vector by n_atoms."""

    def forward(self, h, batch, n_atoms):
        total = torch.zeros(len(n_atoms), h.shape[1], dtype=h.dtype).index_add_(0, batch, h)
        return total / n_atoms[:, None]


class MeanStdPool(nn.Module):
    """Each crystal's mean and standard deviation of its atoms' features (a multi-aggregation
    readout), the variance E[h^2] - E[h]^2 clamped at 0 against rounding."""

    def forward(self, h, batch, n_atoms):
        total = torch.zeros(len(n_atoms), h.shape[1], dtype=h.dtype).index_add_(0, batch, h)
        sq = torch.zeros(len(n_atoms), h.shape[1], dtype=h.dtype).index_add_(0, batch, h * h)
        mean, mean_sq = total / n_atoms[:, None], sq / n_atoms[:, None]
        std = torch.sqrt((mean_sq - mean ** 2).clamp_min(0.0))  # the bug: no eps under the root
        return torch.cat([mean, std], dim=1)


class CrystalGraphConvNet(nn.Module):
    """CGCNN: an atom embedding plus the site descriptors, ``n_conv`` gated convolutions over
    the Gaussian-expanded bonds, a crystal pooling, a softplus MLP to both targets."""

    def __init__(self, atom_fea_len: int = 16, n_conv: int = 2, h_fea_len: int = 32,
                 dmax: float = CUTOFF, normalise_rbf: bool = False, aggregate: str = "sum",
                 where_guard: bool = False, pool: str = "mean", angles: bool = False):
        super().__init__()
        self.embedding = nn.Embedding(100, atom_fea_len)
        self.site = nn.Linear(2, atom_fea_len)
        self.rbf = GaussianDistance(dmax=dmax, normalise=normalise_rbf)
        nbr = len(self.rbf.filter)
        self.angles = BondAngles(nbr) if angles else None
        self.convs = nn.ModuleList(ConvLayer(atom_fea_len, nbr, aggregate, where_guard)
                                   for _ in range(n_conv))
        self.pool = {"attention": AttentionPool(atom_fea_len), "mean": MeanPool(),
                     "mean_std": MeanStdPool()}[pool]
        self.conv_to_fc = nn.Linear(atom_fea_len * (2 if pool == "mean_std" else 1), h_fea_len)
        self.fc_out = nn.Linear(h_fea_len, 2)

    def forward(self, z, site, edge_index, dist, batch, n_atoms, vec=None, triplets=None):
        h = self.embedding(z) + self.site(site)
        edge_fea = self.rbf(dist)
        if self.angles is not None:
            edge_fea = self.angles(vec, triplets, edge_fea)
        for conv in self.convs:
            h = conv(h, edge_index, edge_fea)
        crys = self.pool(h, batch, n_atoms)
        return self.fc_out(nn.functional.softplus(self.conv_to_fc(crys)))


def make_cgcnn(**kw) -> CrystalGraphConvNet:
    torch.manual_seed(0)
    return CrystalGraphConvNet(**kw)


class Normalizer(nn.Module):
    """CGCNN's Normalizer: the mean and std of the training targets, per target column."""

    def __init__(self, targets: torch.Tensor):
        super().__init__()
        self.register_buffer("mean", targets.mean(0))
        self.register_buffer("std", targets.std(0))

    def norm(self, y):
        return (y - self.mean) / self.std


class StandardisedL1(nn.Module):
    """The L1 between the predictions and the standardised targets, over the labelled
    entries ``mask`` (G, 2) (a crystal with no elastic tensor has no bulk modulus)."""

    def __init__(self, normalizer: Normalizer):
        super().__init__()
        self.normalizer = normalizer

    def forward(self, pred, y, mask):
        err = (pred - self.normalizer.norm(y)).abs() * mask
        return err.sum() / mask.sum()


# data


def crystal(g: torch.Generator, n: int, a: float):
    """A cubic cell of lattice constant ``a`` with ``n`` atoms at random fractional positions
    (none closer than 1.8 Angstrom to another or its images), species from ``ELEMENTS``."""
    species = torch.tensor(list(ELEMENTS))
    z = species[torch.randperm(len(species), generator=g)[:n]]  # (n distinct species)
    lattice = torch.eye(3) * a
    while True:
        frac = torch.rand(n, 3, generator=g)
        if n == 1 or min_image(frac, lattice)[0][~torch.eye(n, dtype=torch.bool)].min() > 1.8:
            return z, frac, lattice


def min_image(frac, lattice):
    """Minimum-image distances between every pair of sites ``(n, n)`` and their vectors."""
    d = frac[None] - frac[:, None]
    d = d - torch.round(d)
    cart = d @ lattice
    return cart.norm(dim=-1), cart


def neighbour_list(frac, lattice, cutoff: float = CUTOFF):
    """The bonds (j -> i) of one crystal within ``cutoff``, by the minimum-image convention
    over the other sites of the cell (a site's own periodic images are not searched), and their
    lengths."""
    dist, cart = min_image(frac, lattice)
    near = (dist < cutoff) & ~torch.eye(len(frac), dtype=torch.bool)
    i, j = torch.nonzero(near, as_tuple=True)
    return torch.stack([j, i]), dist[i, j], cart[i, j]


def triplets_of(edges):
    """The line graph's pairs of distinct bonds (e1, e2) of one centre atom (their receiver)."""
    same = (edges[1][:, None] == edges[1][None]) & ~torch.eye(edges.shape[1], dtype=torch.bool)
    return torch.stack(torch.nonzero(same, as_tuple=True))


def labels(z, frac, lattice, g: torch.Generator):
    """Toy formation energy (eV/atom) and bulk modulus (GPa) from composition and density."""
    chi = torch.tensor([ELEMENTS[int(k)][0] for k in z])
    e_form = -0.4 * chi.std(unbiased=False) - 0.1 * torch.rand((), generator=g)
    vol = torch.linalg.det(lattice) / len(z)
    k_vrh = 2000.0 / vol + 20 * torch.rand((), generator=g)
    return e_form, k_vrh


def dataset(plant: str, bad_step: int, bad: int, steps: int = 4, per_batch: int = 4):
    """The crystals of ``steps`` batches of ``per_batch``; crystal ``bad`` of step ``bad_step``
    is broken as ``plant`` says: ``"empty"``, a disordered structure whose partially occupied
    sites a filter dropped (0 atoms); ``"single"``, a one-atom primitive cell (bcc Fe), whose
    only neighbours are its own images, which the minimum-image search never visits;
    ``"elemental_pair"``, bcc Fe's 2-atom conventional cell, its two atoms alike in species
    and surroundings; ``"linear"``, cuprite's linear O-Cu-O unit, two bonds at 180 degrees;
    ``"negative_k"``, a mechanically unstable crystal whose K_VRH is negative (the log10 of
    the collate_fn is NaN); ``"long_bond"``, a 2-atom cell of a = 10 Angstrom whose bond of
    8.6 Angstrom the neighbour list (cutoff 9) keeps; ``"pm_radius"``, its sites' covalent
    radius read from a table in picometres. Each item is (z, site, frac, lattice, e, k)."""
    g = torch.Generator().manual_seed(5)
    items = []
    for step in range(steps):
        for k in range(per_batch):
            here = step == bad_step and k == bad
            n = int(torch.randint(2, 5, (1,), generator=g))
            a = 4.2 + 1.2 * torch.rand((), generator=g).item()
            if here and plant == "single":
                n, a = 1, 2.87
            z, frac, lattice = crystal(g, n, a)
            if here and plant == "elemental_pair":  # (bcc Fe's conventional cell)
                z, frac, lattice = torch.tensor([26, 26]), torch.tensor([[0.0] * 3, [0.5] * 3]), \
                    torch.eye(3) * 2.87
            if here and plant == "linear":  # (cuprite's linear O-Cu-O unit)
                z, lattice = torch.tensor([8, 29, 29]), torch.eye(3) * 4.27
                centre, d = torch.tensor([0.5] * 3), torch.tensor([-0.300, 0.274, 0.140])
                frac = torch.stack([centre, centre + d, centre - d])
            if here and plant == "long_bond":
                z, lattice = z[:2], torch.eye(3) * 10.0
                frac = torch.tensor([[0.0, 0.0, 0.0], [0.5, 0.5, 0.49]])
            e, kv = labels(z, frac, lattice, g)
            site = torch.tensor([ELEMENTS[int(s)] for s in z])
            if here and plant == "pm_radius":  # (a titanium magnesium alloy)
                z = torch.tensor([22, 12, 22, 12])[:n]
                site = torch.tensor([ELEMENTS[int(s)] for s in z])
                site[:, 1] *= 100.0
            if here and plant == "empty":
                z, site, frac = z[:0], site[:0], frac[:0]
            if here and plant == "negative_k":
                kv = -kv
            items.append((z, site, frac, lattice, e, kv))
    return items


def collate_pool(items, cutoff: float = CUTOFF):
    """CGCNN's ``collate_pool``: the crystals joined into one graph, the neighbour list built
    per crystal and offset, the site descriptors standardised, the targets (formation energy,
    log10 K_VRH) stacked with their mask."""
    z, site, edges, dist, batch, n, y, vec, trip = [], [], [], [], [], [], [], [], []
    offset = n_edges = 0
    for k, (zk, sk, fk, lk, e, kv) in enumerate(items):
        ek, dk, vk = neighbour_list(fk, lk, cutoff)
        vec.append(vk)
        trip.append(triplets_of(ek) + n_edges)
        n_edges += ek.shape[1]
        z.append(zk)
        site.append((sk - SITE_MEAN) / SITE_STD)
        edges.append(ek + offset)
        dist.append(dk)
        batch.append(torch.full((len(zk),), k))
        n.append(len(zk))
        y.append(torch.stack([e, torch.log10(kv)]))
        offset += len(zk)
    y = torch.stack(y)
    return {"z": torch.cat(z), "site": torch.cat(site), "edge_index": torch.cat(edges, 1),
            "dist": torch.cat(dist), "batch": torch.cat(batch),
            "n_atoms": torch.tensor(n, dtype=torch.float32), "y": y,
            "mask": torch.ones_like(y), "vec": torch.cat(vec), "triplets": torch.cat(trip, 1)}


def loader(plant: str, bad_step: int, bad: int, steps: int = 4, per_batch: int = 4,
           cutoff: float = CUTOFF):
    return torch.utils.data.DataLoader(
        dataset(plant, bad_step, bad, steps, per_batch), batch_size=per_batch, shuffle=False,
        collate_fn=lambda items: collate_pool(items, cutoff))


def training_targets(plant: str = "none") -> torch.Tensor:
    """The targets of the training set the Normalizer is fitted on (``"elemental"``: a sample
    of the training set that holds only elemental solids, whose formation energy is 0;
    ``"one"``: a debug subset of one crystal)."""
    y = torch.stack([collate_pool(dataset("none", -1, -1, 8, 4)[i:i + 4])["y"]
                     for i in range(0, 32, 4)]).reshape(-1, 2)
    if plant == "elemental":
        y = y.clone()
        y[:, 0] = 0.0
    return y[:1] if plant == "one" else y
