"""Machine-learned interatomic potentials as NequIP, MACE and SchNetPack write them, in plain
PyTorch (``test_interatomic_potentials.py``). A batch of structures is a dict, as a
``DataLoader``'s collate over atoms makes it: atomic numbers ``z (N,)``, positions
``pos (N, 3)``, the neighbour list ``edge_index (2, E)`` (senders, receivers) built by the data
pipeline, the ``batch`` vector ``(N,)``, ``n_atoms (G,)``, the cell ``(G, 3, 3)`` (zeros for a
molecule) and the labels: energy ``(G,)``, forces ``(N, 3)``, stress ``(G, 3, 3)``, and the
stress weight ``(G,)`` (0 where the structure has no stress label). The model returns the
energy, the forces ``-dE/dpos`` and, asked to, the stress ``dE/dstrain / volume`` (MACE's
``get_outputs``), all from ``autograd.grad(..., create_graph=True)`` in its forward, so the
step's backward differentiates twice."""

from __future__ import annotations

import math

import torch
from torch import nn

R_MAX = 4.0


class BesselBasis(nn.Module):
    """NequIP's radial Bessel basis: 2/r_max sin(n pi r / r_max) / r, frequencies learned."""

    def __init__(self, r_max: float = R_MAX, num_basis: int = 8):
        super().__init__()
        self.r_max, self.prefactor = r_max, 2.0 / r_max
        self.bessel_weights = nn.Parameter(torch.linspace(1.0, num_basis, num_basis) * math.pi)

    def forward(self, r):
        numerator = torch.sin(self.bessel_weights * r[:, None] / self.r_max)
        return self.prefactor * (numerator / r[:, None])


class SincLimitBesselBasis(BesselBasis):
    """The Bessel basis "made safe" at r = 0 by its limit, w / r_max, under a torch.where."""

    def forward(self, r):
        rr = r[:, None]
        numerator = torch.sin(self.bessel_weights * rr / self.r_max)
        # the bug: the forces' backward still runs the dropped 0/0 branch (0 * NaN)
        safe = torch.where(rr > 0, numerator / rr, self.bessel_weights / self.r_max)
        return self.prefactor * safe


class GaussianBasis(nn.Module):
    """SchNet's Gaussian smearing of the distance."""

    def __init__(self, r_max: float = R_MAX, num_basis: int = 8):
        super().__init__()
        self.register_buffer("offsets", torch.linspace(0.0, r_max, num_basis))
        self.coeff = -0.5 / (r_max / (num_basis - 1)) ** 2

    def forward(self, r):
        return torch.exp(self.coeff * (r[:, None] - self.offsets) ** 2)


class PolynomialCutoff(nn.Module):
    """NequIP's polynomial envelope: 1 at r = 0, smoothly 0 at r_max (p = 6)."""

    def __init__(self, r_max: float = R_MAX, p: float = 6.0):
        super().__init__()
        self.r_max, self.p = r_max, p

    def forward(self, r):
        x, p = r / self.r_max, self.p
        out = (1.0 - (p + 1.0) * (p + 2.0) / 2.0 * x ** p + p * (p + 2.0) * x ** (p + 1.0)
               - p * (p + 1.0) / 2.0 * x ** (p + 2.0))
        return out * (x < 1.0)


class SmoothCutoff(nn.Module):
    """The smooth step (1 - (r / r_max)^2)^(3/2) some potentials use as their envelope,
    masked to 0 past r_max."""

    def __init__(self, r_max: float = R_MAX):
        super().__init__()
        self.r_max = r_max

    def forward(self, r):
        # the bug: past r_max the base is negative and its power 1.5 is NaN, which * 0 keeps
        return (1.0 - (r / self.r_max) ** 2) ** 1.5 * (r < self.r_max)


class Interaction(nn.Module):
    """A SchNet/NequIP-style invariant message: a radial MLP of the edge's basis multiplies
    the sender's features, summed into the receiver with ``index_add_`` and averaged by the
    expected neighbour count (MACE's ``avg_num_neighbors``)."""

    def __init__(self, hidden: int, num_basis: int, avg_num_neighbors: float = 4.0):
        super().__init__()
        self.radial = nn.Sequential(nn.Linear(num_basis, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.linear = nn.Linear(hidden, hidden)
        self.update = nn.Sequential(nn.SiLU(), nn.Linear(hidden, hidden))
        self.avg_num_neighbors = avg_num_neighbors

    def forward(self, h, edge_feats, edge_index):
        sender, receiver = edge_index
        msg = self.linear(h)[sender] * self.radial(edge_feats)
        agg = msg.new_zeros(h.shape).index_add_(0, receiver, msg) / self.avg_num_neighbors
        return h + self.update(agg)


class Repulsion(nn.Module):
    """A learned short-range pair repulsion (sigma_ij / r)^12 as ZBL/LJ-corrected potentials
    add, its length scale from both atoms' species."""

    def __init__(self, hidden: int):
        super().__init__()
        self.sigma = nn.Linear(hidden, 1)

    def forward(self, h, r, edge_index):
        sender, receiver = edge_index
        sigma = nn.functional.softplus(self.sigma(h)).squeeze(-1)
        s = 0.5 * (sigma[sender] + sigma[receiver])
        pair = (s / r) ** 12  # the bug: in float16 a close pair's (s / r)^12 passes 65504
        return pair.new_zeros(len(h)).index_add_(0, receiver, 0.5 * pair)


class Potential(nn.Module):
    """An invariant message-passing potential: the energy is a sum of atomic energies per
    structure (``index_add_`` over the batch vector), the forces -dE/dpos and the stress
    (dE/d strain) / volume, MACE's way: a symmetric displacement applied to the positions."""

    def __init__(self, hidden: int = 32, num_basis: int = 8, r_max: float = R_MAX,
                 layers: int = 2, basis: str = "bessel", cutoff: str = "polynomial",
                 repulsion: bool = False, avg_num_neighbors: float = 4.0,
                 stress_guard: bool = False):
        super().__init__()
        self.stress_guard = stress_guard
        self.embedding = nn.Embedding(10, hidden)
        bases = {"bessel": BesselBasis, "sinc_limit": SincLimitBesselBasis, "gaussian": GaussianBasis}
        self.basis = bases[basis](r_max, num_basis)
        self.cutoff = PolynomialCutoff(r_max) if cutoff == "polynomial" else SmoothCutoff(r_max)
        self.interactions = nn.ModuleList(Interaction(hidden, num_basis, avg_num_neighbors)
                                          for _ in range(layers))
        self.repulsion = Repulsion(hidden) if repulsion else None
        self.readout = nn.Sequential(nn.Linear(hidden, hidden // 2), nn.SiLU(), nn.Linear(hidden // 2, 1))

    def forward(self, z, pos, edge_index, batch, n_atoms, cell, compute_stress: bool = False):
        with torch.enable_grad():  # (the forces need it, in validation too)
            return self._outputs(z, pos, edge_index, batch, n_atoms, cell, compute_stress)

    def _outputs(self, z, pos, edge_index, batch, n_atoms, cell, compute_stress):
        num_graphs = len(n_atoms)
        pos = pos.requires_grad_(True)
        displacement = torch.zeros(num_graphs, 3, 3, dtype=pos.dtype, requires_grad=compute_stress)
        strain = 0.5 * (displacement + displacement.transpose(-1, -2))
        positions = pos + torch.einsum("be,bec->bc", pos, strain[batch])
        cell = cell + torch.matmul(cell, strain)
        sender, receiver = edge_index
        vectors = positions[sender] - positions[receiver]
        lengths = torch.linalg.norm(vectors, dim=-1)
        edge_feats = self.basis(lengths) * self.cutoff(lengths)[:, None]
        h = self.embedding(z)
        for block in self.interactions:
            h = block(h, edge_feats, edge_index)
        e_atom = self.readout(h).squeeze(-1)
        if self.repulsion is not None:
            e_atom = e_atom + self.repulsion(h, lengths, edge_index).to(e_atom.dtype)
        energy = torch.zeros(num_graphs, dtype=e_atom.dtype).index_add_(0, batch, e_atom)
        inputs = [pos, displacement] if compute_stress else [pos]
        grads = torch.autograd.grad(energy.sum(), inputs, create_graph=self.training)
        out = {"energy": energy, "forces": -grads[0]}
        if compute_stress:
            volume = torch.linalg.det(cell).abs()
            # the bug: a molecule's cell is zeros, its volume 0 (MACE zeroes |stress| > 1e10)
            out["stress"] = grads[1] / volume[:, None, None]
            if self.stress_guard:  # MACE's guard: the forward's values are finite, the backward's not
                out["stress"] = torch.where(out["stress"].abs() < 1e10, out["stress"], 0.0)
        return out


def make_potential(**kw) -> Potential:
    torch.manual_seed(0)
    return Potential(**kw)


class WeightedEnergyForcesStressLoss(nn.Module):
    """MACE's / NequIP's loss: the energy per atom's squared error, the forces', and the
    stress's weighted per structure (0 where a structure has no stress label)."""

    def __init__(self, energy_weight: float = 1.0, forces_weight: float = 10.0,
                 stress_weight: float = 1.0):
        super().__init__()
        self.energy_weight, self.forces_weight = energy_weight, forces_weight
        self.stress_weight = stress_weight

    def forward(self, pred, energy, forces, n_atoms, stress=None, stress_weight=None):
        # the bug: a structure with no atoms is 0 / 0 here
        e = ((pred["energy"] - energy) / n_atoms) ** 2
        loss = self.energy_weight * e.mean() + self.forces_weight * ((pred["forces"] - forces) ** 2).mean()
        if stress is not None:
            s = stress_weight[:, None, None] * (pred["stress"] - stress) ** 2
            loss = loss + self.stress_weight * s.mean()
        return loss


# ---------------------------------------------------------------------------------------------
# data


def structure(g: torch.Generator, n: int, periodic: bool):
    """A random cluster of ``n`` atoms in a 2.2 Angstrom box (every pair inside r_max, none
    closer than 0.8, as relaxed and MD frames hold them), species from a small set; a crystal
    gets a cubic cell of its lattice constant."""
    z = torch.tensor([1, 6, 7, 8])[torch.randint(0, 4, (n,), generator=g)]
    while True:
        pos = (torch.rand(n, 3, generator=g) - 0.5) * 2.2
        if (torch.pdist(pos) > 0.8).all():
            break
    a = 2.5 + torch.rand((), generator=g).item()
    cell = torch.eye(3) * a if periodic else torch.zeros(3, 3)
    return z, pos, cell


def reference(z, pos, cell):
    """Labels from a toy Morse pair potential: energy (eV), forces (eV/A), stress (eV/A^3)."""
    p = pos.detach().clone().requires_grad_(True)
    eye = torch.eye(len(p))
    d = ((p[:, None] - p[None]) ** 2).sum(-1).add(eye).sqrt()
    e = 0.5 * (((1 - torch.exp(-(d - 1.2))) ** 2) * (1 - eye)).sum()
    (grad,) = torch.autograd.grad(e, p)
    vol = torch.linalg.det(cell).abs()
    stress = (-(p.detach().T @ grad) / vol) if vol > 0 else torch.zeros(3, 3)
    return e.detach(), -grad, stress


def neighbour_list(pos, cutoff: float, self_edges: bool = False):
    """The pairs (sender j, receiver i) of one structure closer than ``cutoff``;
    ``self_edges`` keeps the (i, i) pairs, as an image search over periodic shifts does when
    it forgets to drop the zero shift."""
    near = torch.cdist(pos, pos) < cutoff
    if not self_edges:
        near &= ~torch.eye(len(pos), dtype=torch.bool)
    i, j = torch.nonzero(near, as_tuple=True)
    return torch.stack([j, i])


def dataset(plant: str, bad_step: int, bad: int, steps: int = 4, per_batch: int = 4):
    """The structures of ``steps`` batches of ``per_batch``; structure ``bad`` of step
    ``bad_step`` is broken as ``plant`` says: ``"self_edge"``, its neighbour list keeps each
    atom's pair with itself; ``"empty"``, a frame whose atoms a filter removed (0 atoms);
    ``"stale"``, an MD frame whose neighbour list (of the first frame, built at r_max + a
    1 Angstrom skin) was not rebuilt after an atom moved 1.3 r_max away; ``"molecule"``, every
    other structure is a crystal, this one a molecule (no cell, no stress label); ``"close"``,
    two of its atoms 0.1 Angstrom apart, ``"coincident"``, at one position (a duplicated atom
    of a format conversion); ``"crystals"``, every structure periodic. Each item
    is (z, pos, edges, cell, energy, forces, stress, stress_weight)."""
    g = torch.Generator().manual_seed(3)
    items = []
    for step in range(steps):
        for k in range(per_batch):
            here = step == bad_step and k == bad
            periodic = (plant == "molecule" and not here) or plant == "crystals"
            z, pos, cell = structure(g, int(torch.randint(3, 7, (1,), generator=g)), periodic)
            edges = neighbour_list(pos, R_MAX + (1.0 if plant == "stale" else 0.0),
                                   self_edges=here and plant == "self_edge")
            if here and plant == "empty":
                z, pos, edges = z[:0], pos[:0], edges[:, :0]
            if here and plant == "stale":
                pos = pos.clone()
                pos[0] = pos[1] + torch.tensor([1.3 * R_MAX, 0.0, 0.0])
            if here and plant in ("close", "coincident"):
                pos = pos.clone()
                pos[1] = pos[0] + torch.tensor([0.1 if plant == "close" else 0.0, 0.0, 0.0])
            e, f, s = reference(z, pos, cell)
            items.append((z, pos, edges, cell, e, f, s, torch.tensor(float(periodic))))
    return items


def collate(items):
    """Structures concatenated atom by atom (PyG's ``Batch.from_data_list``): the edges
    offset by the atoms before them, the batch vector, the per-structure labels stacked."""
    z, pos, edges, batch, cells, e, f, s, w, n = [], [], [], [], [], [], [], [], [], []
    offset = 0
    for k, (zk, pk, ek, ck, en, fk, sk, wk) in enumerate(items):
        z.append(zk)
        pos.append(pk)
        edges.append(ek + offset)
        batch.append(torch.full((len(zk),), k))
        cells.append(ck)
        e.append(en)
        f.append(fk)
        s.append(sk)
        w.append(wk)
        n.append(len(zk))
        offset += len(zk)
    return {"z": torch.cat(z), "pos": torch.cat(pos), "edge_index": torch.cat(edges, 1),
            "batch": torch.cat(batch), "n_atoms": torch.tensor(n, dtype=torch.float32),
            "cell": torch.stack(cells), "energy": torch.stack(e), "forces": torch.cat(f),
            "stress": torch.stack(s), "stress_weight": torch.stack(w)}


def avg_num_neighbors(items, cutoff: float) -> float:
    """MACE's ``compute_avg_num_neighbors`` over the training set: pairs within ``cutoff``
    per atom, counted from the positions."""
    pairs = sum(int((torch.pdist(it[1]) < cutoff).sum()) * 2 for it in items if len(it[1]) > 1)
    return pairs / sum(len(it[0]) for it in items)


def loader(plant: str, bad_step: int, bad: int, steps: int = 4, per_batch: int = 4):
    return torch.utils.data.DataLoader(dataset(plant, bad_step, bad, steps, per_batch),
                                       batch_size=per_batch, shuffle=False, collate_fn=collate)
