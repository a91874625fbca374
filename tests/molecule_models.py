"""Interatomic potentials written as SchNet / SchNetPack, DimeNet and NequIP write them, in
plain PyTorch (``test_molecules.py``). A batch of molecules is concatenated atom by atom, as
PyG's ``Batch`` does: atomic numbers ``z (N,)``, positions ``pos (N, 3)``, a ``batch`` vector
``(N,)`` naming each atom's molecule; labels are one energy per molecule ``(G,)`` and one force
per atom ``(N, 3)``. The model predicts the energy and, as SchNetPack's ``Forces`` output
module and NequIP's ``ForceOutput`` do, the forces as ``-dE/dpos`` with
``autograd.grad(..., create_graph=True)`` inside its forward; the loss mixes both, so the
step's backward differentiates twice."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def radius_graph(pos: torch.Tensor, batch: torch.Tensor, cutoff: float, loop: bool = False):
    """torch_cluster's ``radius_graph``: the pairs (j -> i) of atoms of one molecule closer
    than ``cutoff``; ``loop`` keeps each atom's pair with itself."""
    with torch.no_grad():
        same = batch[:, None] == batch[None, :]
        near = torch.cdist(pos, pos) < cutoff
        if not loop:
            near &= ~torch.eye(len(pos), dtype=torch.bool, device=pos.device)
        i, j = torch.nonzero(same & near, as_tuple=True)
    return torch.stack([j, i])


class Distances(nn.Module):
    """Interatomic distances and unit vectors of the edges (SchNetPack's
    ``PairwiseDistances``)."""

    def forward(self, pos, edge_index):
        j, i = edge_index
        vec = pos[j] - pos[i]
        d = torch.sqrt((vec ** 2).sum(-1))  # the bug: d(sqrt)/dx at a 0 distance is 0/0
        return d, vec


class GaussianRBF(nn.Module):
    """SchNet's Gaussian smearing of the distance, with a cosine cutoff envelope."""

    def __init__(self, n: int = 16, cutoff: float = 5.0):
        super().__init__()
        self.cutoff = cutoff
        self.register_buffer("offsets", torch.linspace(0, cutoff, n))
        self.width = (cutoff / (n - 1)) ** 2

    def forward(self, d):
        rbf = torch.exp(-0.5 * (d[:, None] - self.offsets) ** 2 / self.width)
        fcut = 0.5 * (torch.cos(d * math.pi / self.cutoff) + 1.0) * (d < self.cutoff)
        return rbf * fcut[:, None]


class BesselRBF(nn.Module):
    """DimeNet's radial Bessel basis sqrt(2/c) sin(n pi d / c) / d, with its polynomial
    envelope; frequencies learned."""

    def __init__(self, n: int = 8, cutoff: float = 5.0):
        super().__init__()
        self.cutoff = cutoff
        self.freq = nn.Parameter(torch.arange(1, n + 1, dtype=torch.float32) * math.pi)

    def forward(self, d):
        x = (d / self.cutoff)[:, None]
        return math.sqrt(2 / self.cutoff) * torch.sin(self.freq * x) / d[:, None]


class CFConv(nn.Module):
    """SchNet's continuous-filter convolution: a filter made from the radial basis multiplies
    the neighbour's features, summed into the atom with ``index_add_``; ``mean`` divides by
    the atom's neighbour count (the mean aggregation some variants use)."""

    def __init__(self, hidden: int, n_rbf: int, mean: bool = False):
        super().__init__()
        self.filter = nn.Sequential(nn.Linear(n_rbf, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.lin = nn.Linear(hidden, hidden)
        self.out = nn.Sequential(nn.SiLU(), nn.Linear(hidden, hidden))
        self.mean = mean

    def forward(self, h, rbf, edge_index):
        j, i = edge_index
        msg = self.lin(h)[j] * self.filter(rbf)
        agg = torch.zeros_like(h).index_add_(0, i, msg)
        if self.mean:
            deg = torch.zeros(len(h), device=h.device).index_add_(0, i, torch.ones_like(i, dtype=h.dtype))
            agg = agg / deg[:, None]  # the bug: an atom with no neighbour in the cutoff is 0/0
        return h + self.out(agg)


class Angles(nn.Module):
    """DimeNet-style angular messages: for each pair of edges k -> j -> i, the angle at j from
    ``acos`` of the clamped cosine (DimeNet itself takes atan2 of the cross and dot products),
    expanded in cos(n * angle) and summed into atom i."""

    def __init__(self, hidden: int, n: int = 4):
        super().__init__()
        self.register_buffer("orders", torch.arange(n, dtype=torch.float32))
        self.lin = nn.Linear(n, hidden)

    def forward(self, h, d, vec, edge_index):
        j, i = edge_index
        # the triplets: edge a (k -> j) followed by edge b (j -> i), k != i
        a, b = torch.nonzero((i[:, None] == j[None, :]) & (j[:, None] != i[None, :]), as_tuple=True)
        cos = (-vec[a] * vec[b]).sum(-1) / (d[a] * d[b])
        angle = torch.acos(cos.clamp(-1.0, 1.0))  # the bug: acos' is infinite at +-1 (a linear molecule)
        msg = self.lin(torch.cos(self.orders * angle[:, None]))
        return h + torch.zeros_like(h).index_add_(0, i[b], msg)


class Electrostatics(nn.Module):
    """PhysNet's Coulomb term: partial charges from each atom's features, shifted so each
    molecule is neutral, and k q_i q_j / r_ij summed over the pairs (eV, Angstrom)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.charge = nn.Linear(hidden, 1)

    def forward(self, h, d, edge_index, batch, num_molecules: int):
        q = self.charge(h).squeeze(-1)
        total = torch.zeros(num_molecules, dtype=q.dtype, device=q.device).index_add_(0, batch, q)
        count = torch.bincount(batch, minlength=num_molecules).to(q.dtype)
        q = q - (total / count)[batch]
        j, i = edge_index
        pair = 14.399645 * q[i] * q[j] / d  # the bug: 1/r at two coincident atoms is inf
        return 0.5 * torch.zeros_like(q).index_add_(0, i, pair)


class VectorFeatures(nn.Module):
    """PaiNN's equivariant features: v_i = sum_j W(rbf_ij) h_j (vec_ij / d_ij), and an update
    that reads their norm ||v_i|| (PaiNN adds 1e-8 under the root)."""

    def __init__(self, hidden: int, n_rbf: int):
        super().__init__()
        self.filter = nn.Linear(n_rbf, hidden)
        self.mix = nn.Linear(2 * hidden, hidden)

    def forward(self, h, rbf, d, vec, edge_index):
        j, i = edge_index
        w = self.filter(rbf) * h[j]
        msg = (vec / d[:, None])[:, :, None] * w[:, None, :]
        v = torch.zeros(len(h), 3, h.shape[1], dtype=h.dtype, device=h.device).index_add_(0, i, msg)
        norm = torch.sqrt((v ** 2).sum(1))  # the bug: a symmetric atom's v is exactly 0
        return h + self.mix(torch.cat([h, norm], -1))


class SchNet(nn.Module):
    """SchNet with SchNetPack's output heads: the molecule's energy, a sum of atomwise
    contributions over its atoms (``index_add_`` over the batch vector), and the forces as
    ``-dE/dpos``."""

    def __init__(self, hidden: int = 32, n_rbf: int = 16, cutoff: float = 5.0, blocks: int = 2,
                 basis: str = "gaussian", mean: bool = False, loop: bool = False,
                 angles: bool = False, coulomb: bool = False, forces: bool = True,
                 vectors: bool = False):
        super().__init__()
        self.cutoff, self.loop = cutoff, loop
        self.embedding = nn.Embedding(20, hidden)
        self.distances = Distances()
        self.rbf = GaussianRBF(n_rbf, cutoff) if basis == "gaussian" else BesselRBF(n_rbf, cutoff)
        self.interactions = nn.ModuleList(CFConv(hidden, n_rbf, mean) for _ in range(blocks))
        self.angles = Angles(hidden) if angles else None
        self.electrostatics = Electrostatics(hidden) if coulomb else None
        self.forces = forces
        self.vectors = VectorFeatures(hidden, n_rbf) if vectors else None
        self.atomwise = nn.Sequential(nn.Linear(hidden, hidden // 2), nn.SiLU(), nn.Linear(hidden // 2, 1))

    def forward(self, z, pos, batch, num_molecules: int):
        with torch.enable_grad():  # (validation runs under no_grad: the forces need it)
            return self._energy_forces(z, pos, batch, num_molecules)

    def _energy_forces(self, z, pos, batch, num_molecules: int, edge_index=None):
        pos.requires_grad_(True)  # SchNetPack: inputs[R].requires_grad_()
        if edge_index is None:
            edge_index = radius_graph(pos, batch, self.cutoff, self.loop)
        d, vec = self.distances(pos, edge_index)
        rbf = self.rbf(d)
        h = self.embedding(z)
        if self.angles is not None:
            h = self.angles(h, d, vec, edge_index)
        for block in self.interactions:
            h = block(h, rbf, edge_index)
        if self.vectors is not None:
            h = self.vectors(h, rbf, d, vec, edge_index)
        e_atom = self.atomwise(h).squeeze(-1)
        if self.electrostatics is not None:
            e_atom = e_atom + self.electrostatics(h, d, edge_index, batch, num_molecules)
        energy = torch.zeros(num_molecules, device=pos.device, dtype=pos.dtype).index_add_(0, batch, e_atom)
        if not self.forces:  # (the loss differentiates it, given the positions)
            return energy
        forces = -torch.autograd.grad(energy.sum(), pos, create_graph=self.training)[0]
        return energy, forces


def make_schnet(**kw) -> SchNet:
    torch.manual_seed(0)
    return SchNet(**kw)


class SchNetPackModel(SchNet):
    """SchNetPack's calling convention: one dict of inputs, as its collate makes it (the
    neighbour list ``_idx_i``/``_idx_j`` from the data pipeline, the batch vector ``_idx_m``
    last), into which the model writes its predictions and which it returns."""

    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        with torch.enable_grad():
            edges = torch.stack([inputs["_idx_j"], inputs["_idx_i"]])
            energy, forces = self._energy_forces(
                inputs["_atomic_numbers"], inputs["_positions"], inputs["_idx_m"],
                len(inputs["_n_atoms"]), edges)
        inputs["energy"], inputs["forces"] = energy, forces
        return inputs


def make_schnetpack(**kw) -> SchNetPackModel:
    torch.manual_seed(0)
    return SchNetPackModel(**kw)


class SchNetPackLoss(nn.Module):
    """SchNetPack's ``ModelOutput`` losses summed: the predictions' dict against the targets'."""

    def __init__(self, energy_weight: float = 0.01, force_weight: float = 0.99):
        super().__init__()
        self.energy_weight, self.force_weight = energy_weight, force_weight

    def forward(self, pred: dict, targets: dict):
        return (self.energy_weight * F.mse_loss(pred["energy"], targets["energy"])
                + self.force_weight * F.mse_loss(pred["forces"], targets["forces"]))


def schnetpack_collate(z, pos, batch, e, f, cutoff: float = 5.0) -> dict[str, torch.Tensor]:
    """The dict SchNetPack's ``_atoms_collate_fn`` makes, in its key order."""
    j, i = radius_graph(pos, batch, cutoff)
    return {"_n_atoms": torch.bincount(batch), "_atomic_numbers": z, "_positions": pos,
            "energy": e, "forces": f, "_idx_i": i, "_idx_j": j, "_idx_m": batch}


class EnergyForceLoss(nn.Module):
    """SchNetPack's / NequIP's weighted sum of the energy's and the forces' mean squared
    errors (forces weighted up: there are 3N of them per molecule and they carry the
    potential's shape)."""

    def __init__(self, energy_weight: float = 0.01, force_weight: float = 0.99):
        super().__init__()
        self.energy_weight, self.force_weight = energy_weight, force_weight

    def forward(self, out, energy, forces, pos=None):
        # (given the positions, the model returned the energy alone: the forces are its
        # derivative, taken here as NequIP's and MACE's training code does)
        e, f = out if pos is None else (out, -torch.autograd.grad(out.sum(), pos, create_graph=True)[0])
        return (self.energy_weight * F.mse_loss(e, energy)
                + self.force_weight * F.mse_loss(f, forces))


# ---------------------------------------------------------------------------------------------
# data


def molecule(g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random molecule of ``n`` atoms: heavy atoms (C, N, O) and hydrogens, positions a
    bond length or so apart (Angstrom)."""
    z = torch.tensor([6, 7, 8, 1])[torch.randint(0, 4, (n,), generator=g)]
    pos = torch.randn(n, 3, generator=g) * 1.2
    return z, pos


def reference(z: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels from a toy pair potential (a Morse-like well between every two atoms): the
    energy (eV) and the forces (eV / Angstrom)."""
    p = pos.detach().clone().requires_grad_(True)
    d = (p[:, None] - p[None]).pow(2).sum(-1).add(torch.eye(len(p))).sqrt()
    off = 1 - torch.eye(len(p))
    e = 0.5 * ((1 - torch.exp(-(d - 1.5))) ** 2 * off).sum()
    (grad,) = torch.autograd.grad(e, p)
    return e.detach(), -grad


def collate(mols):
    """PyG's ``Batch.from_data_list`` for molecules: atoms concatenated, the ``batch`` vector,
    one energy per molecule, one force per atom."""
    zs, ps, bs, es, fs = [], [], [], [], []
    for k, (z, pos, e, f) in enumerate(mols):
        zs.append(z)
        ps.append(pos)
        bs.append(torch.full((len(z),), k))
        es.append(e)
        fs.append(f)
    return torch.cat(zs), torch.cat(ps), torch.cat(bs), torch.stack(es), torch.cat(fs)


CO2 = (torch.tensor([8, 6, 8]), torch.tensor([[-1.16, 0.0, 0.0], [0.0, 0.0, 0.0], [1.16, 0.0, 0.0]]))


def batches(plant: str, step_at: int, molecule_at: int, steps: int = 4, molecules: int = 5):
    """Collated batches of random molecules with their labels; at step ``step_at`` molecule
    ``molecule_at`` is broken as ``plant`` says: ``"coincident"``, an atom written twice at
    one position by a format conversion (its labels computed before); ``"linear"``, carbon
    dioxide, whose three atoms lie on a line; ``"mev"``, from step ``step_at`` on, the forces
    of molecule ``molecule_at`` come from a source that gives them in meV / Angstrom."""
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        data = []
        for k in range(molecules):
            z, pos = molecule(g, int(torch.randint(3, 8, (1,), generator=g)))
            here = step == step_at and k == molecule_at
            if here and plant == "linear":
                z, pos = CO2[0], CO2[1] + 0.3
            e, f = reference(z, pos)
            if here and plant == "coincident":
                pos[2] = pos[1]
            if plant == "mev" and step >= step_at and k == molecule_at:
                f = f * 1000.0
            data.append((z, pos, e, f))
        yield collate(data)
