"""Protein-ligand docking and binding affinity as pose-scoring networks write it, in plain
PyTorch (``test_molecular_docking.py``). A batch is a dict a ``DataLoader`` collates from
complexes padded to fixed sizes: ligand coordinates ``lig_pos (B, L, 3)``, pocket coordinates
``prot_pos (B, P, 3)``, atom features of both, the ligand's atom mask ``lig_mask (B, L)``, the
three atoms of each ligand's torsion ``torsion (B, 4)`` (indices into L), the label ``pkd (B,)``
and ``censored (B,)`` (1 where the assay says only "pKd > label"). The scorer mixes a
Vina-like physics head (Gaussian steric, repulsion, Lennard-Jones 12-6 over ``torch.cdist``),
a bond-angle term by ``acos`` of normalised bond vectors, and an invariant message-passing
head with a distance cutoff and a radial basis, averaged over each atom's neighbours."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

L, P, F = 6, 10, 8
CUTOFF = 6.0


class RBF(nn.Module):
    """Gaussian radial basis of a distance, centres 0..cutoff."""

    def __init__(self, n: int = 8, cutoff: float = CUTOFF):
        super().__init__()
        self.register_buffer("centres", torch.linspace(0.0, cutoff, n))
        self.gamma = 10.0 / cutoff

    def forward(self, d):
        return torch.exp(-self.gamma * (d[..., None] - self.centres) ** 2)


class LennardJones(nn.Module):
    """A learned 12-6 term: eps * ((sigma/r)^12 - 2 (sigma/r)^6), sigma and eps per pair."""

    def __init__(self, hidden: int, half: bool = False):
        super().__init__()
        self.sigma = nn.Linear(hidden, 1)
        self.eps = nn.Linear(hidden, 1)
        self.half = half

    def forward(self, pair, d):
        sigma = 2.0 + 0.5 * torch.tanh(self.sigma(pair).squeeze(-1))
        eps = nn.functional.softplus(self.eps(pair).squeeze(-1))
        if self.half:  # pair energies kept in float16 to save memory on big pockets
            sigma, d = sigma.half(), d.half()
        x = sigma / d
        return (eps * (x ** 12 - 2.0 * x ** 6)).float()


class AngleTerm(nn.Module):
    """The bond angle at the torsion's middle atom, acos of the normalised bond vectors' dot,
    scored by a small MLP of (cos, angle)."""

    def __init__(self, clamp: bool = True):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(2, 8), nn.SiLU(), nn.Linear(8, 1))
        self.clamp = clamp

    def forward(self, lig_pos, torsion):
        idx = torsion[:, :3, None].expand(-1, -1, 3)
        a, b, c = torch.gather(lig_pos, 1, idx).unbind(1)
        u = nn.functional.normalize(a - b, dim=-1)
        v = nn.functional.normalize(c - b, dim=-1)
        cos = (u * v).sum(-1)
        if self.clamp:
            cos = cos.clamp(-1 + 1e-6, 1 - 1e-6)
        # the planted bug (clamp=False): a straight angle's cosine rounds past -1 and acos is NaN
        theta = torch.acos(cos)
        return self.mlp(torch.stack([cos, theta], -1)).squeeze(-1)


class CutoffMessages(nn.Module):
    """Invariant message passing ligand <- pocket: messages from pocket atoms within the
    cutoff, weighted by a radial MLP, averaged over each ligand atom's neighbours."""

    def __init__(self, hidden: int, eps: float = 1.0, soft: bool = False):
        super().__init__()
        self.soft = soft
        self.rbf = RBF()
        self.radial = nn.Sequential(nn.Linear(8, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.prot = nn.Linear(F, hidden)
        self.eps = eps

    def forward(self, h_lig, prot_feat, d):
        if self.soft:  # a soft neighbourhood: Gaussian weights of width 2 A, normalised
            w = torch.exp(-d ** 2 / 8.0)
            w = w / w.sum(2, keepdim=True)  # the bug: far from every pocket atom all underflow
            return h_lig + (w[..., None] * self.prot(prot_feat)[:, None]).sum(2)
        within = (d < CUTOFF).float()  # (B, L, P)
        w = self.radial(self.rbf(d)) * within[..., None]
        msg = (w * self.prot(prot_feat)[:, None]).sum(2)
        count = within.sum(2, keepdim=True)
        return h_lig + msg / (count + self.eps)  # eps=0: a ligand atom with no neighbour is 0/0


class IntraLigand(nn.Module):
    """A Gaussian self-contact term over the ligand's own pairwise distances, the diagonal
    masked out after the fact."""

    def __init__(self, safe: bool = True):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(0.1))
        self.safe = safe

    def forward(self, lig_pos):
        diff = lig_pos[:, :, None] - lig_pos[:, None]
        sq = (diff ** 2).sum(-1)
        off = 1.0 - torch.eye(lig_pos.shape[1])
        if self.safe:
            sq = sq + (1.0 - off)
        d = sq.sqrt()  # safe=False: sqrt(0) on the diagonal, whose backward is inf * 0 = NaN
        return self.w * (torch.exp(-d) * off).sum((1, 2))


class PoseScorer(nn.Module):
    """The affinity model: embeddings, cdist, RBF pair MLP, LJ + angle + intra terms,
    messages with a cutoff, masked pooling to a pKd."""

    def __init__(self, hidden: int = 16, lj_half: bool = False, angle_clamp: bool = True,
                 msg_eps: float = 1.0, intra_safe: bool = True, refine_steps: int = 0,
                 soft: bool = False):
        super().__init__()
        self.refine_steps, self.refine_lr = refine_steps, 0.05
        self.lig = nn.Linear(F, hidden)
        self.types = nn.Embedding(10, hidden)  # element types; the batch uses types 0..4 only
        self.rbf = RBF()
        self.pair = nn.Sequential(nn.Linear(8, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.lj = LennardJones(hidden, half=lj_half)
        self.angle = AngleTerm(clamp=angle_clamp)
        self.messages = CutoffMessages(hidden, eps=msg_eps, soft=soft)
        self.intra = IntraLigand(safe=intra_safe)
        self.head = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 1))
        self.lj_scale = nn.Parameter(torch.tensor(0.01))

    def refine(self, lig_pos, prot_pos):
        """The pose optimisation inner loop: gradient descent on the ligand's coordinates
        under the intra-ligand and LJ energies, differentiable (create_graph) so the scorer
        learns through the refined pose; the intra term's unsafe sqrt at the diagonal's 0 makes
        the inner gradient NaN (intra_safe=False)."""
        pos = lig_pos.requires_grad_(True) if not lig_pos.requires_grad else lig_pos
        for _ in range(self.refine_steps):
            d = (pos[:, :, None] - prot_pos[:, None]).norm(dim=-1)  # (cdist: no double backward)
            energy = self.intra(pos).sum() + self.lj_scale * self.lj(self.pair(self.rbf(d)), d).sum()
            (g,) = torch.autograd.grad(energy, pos, create_graph=True)
            pos = pos - self.refine_lr * g
        return pos

    def forward(self, lig_pos, prot_pos, lig_feat, prot_feat, lig_mask, torsion, lig_type=None):
        if self.refine_steps:
            lig_pos = self.refine(lig_pos, prot_pos)
        d = torch.cdist(lig_pos, prot_pos)  # (B, L, P)
        pair = self.pair(self.rbf(d))
        lj = self.lj(pair, d)
        lj = (lj * lig_mask[..., None]).sum((1, 2))
        h = self.lig(lig_feat) if lig_type is None else self.lig(lig_feat) + self.types(lig_type)
        h = self.messages(torch.relu(h), prot_feat, d)
        pooled = (h * lig_mask[..., None]).sum(1) / lig_mask.sum(1, keepdim=True)
        return (self.head(pooled).squeeze(-1) - self.lj_scale * lj
                + self.angle(lig_pos, torsion) + self.intra(lig_pos))


class CensoredMSE(nn.Module):
    """MSE on pKd; a censored label ("pKd > y") costs only where the prediction is below it."""

    def forward(self, pred, pkd, censored, kd_nm=None):
        if kd_nm is not None:  # the label as measured, Kd in nM: pKd = 9 - log10(Kd)
            pkd = 9.0 - torch.log10(kd_nm)
        err = pred - pkd
        err = torch.where(censored.bool(), err.clamp(max=0.0), err)
        return (err ** 2).mean()


class Complexes(Dataset):
    """Deterministic synthetic complexes: a ligand of L atoms on a zig-zag chain near the
    origin, a pocket of P atoms on a shell around it. ``plant`` breaks complex ``bad`` of the
    batch of step ``k``."""

    def __init__(self, n: int, batch: int, plant: str = "", k: int = 2, bad: int = 1):
        self.n, self.batch, self.plant, self.k, self.bad = n, batch, plant, k, bad

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(1000 + i)
        t = torch.arange(L, dtype=torch.float32)
        lig = torch.stack([1.4 * t - 3.5, 0.8 * (t % 2), torch.zeros(L)], -1)
        lig = lig + 0.1 * torch.randn(L, 3, generator=g)
        dirs = nn.functional.normalize(torch.randn(P, 3, generator=g), dim=-1)
        prot = dirs * (4.5 + torch.rand(P, 1, generator=g))
        item = {"lig_pos": lig, "prot_pos": prot, "lig_feat": torch.randn(L, F, generator=g),
                "prot_feat": torch.randn(P, F, generator=g), "lig_mask": torch.ones(L),
                "torsion": torch.tensor([0, 1, 2, 3]),
                "lig_type": torch.randint(0, 5, (L,), generator=g),
                "pkd": 4.0 + 6.0 * torch.rand((), generator=g),
                "censored": torch.tensor(float(i % 5 == 0))}
        item["kd_nm"] = 10.0 ** (9.0 - item["pkd"])
        if i == self.k * self.batch + self.bad:
            plant_item(item, self.plant)
        return item


def plant_item(item: dict, plant: str) -> None:
    """Break one complex the way a pipeline breaks it."""
    if plant == "nan_coords":  # an SDF parse that left a coordinate as NaN
        item["lig_pos"][3, 1] = float("nan")
    elif plant == "overlap":  # a ligand atom placed on a pocket atom
        item["lig_pos"][2] = item["prot_pos"][4]
    elif plant == "straight":  # a linear (sp) angle at the torsion's middle atom
        v = torch.tensor([-0.7911027073860168, -0.02087947353720665, -0.7184800505638123])
        item["lig_pos"][:3] = v * torch.tensor([[1.0], [2.0], [3.0]])
    elif plant == "far":  # a ligand placed far from its pocket (wrong frame in the input)
        item["lig_pos"][:] += 50.0
    elif plant == "kd_zero":  # an assay's "below detection" written as Kd = 0
        item["kd_nm"] = torch.tensor(0.0)
    elif plant == "close":  # a clash in the docked pose: 0.3 A from a pocket atom
        item["lig_pos"][2] = item["prot_pos"][4] * 0.95


def loader(plant: str = "", k: int = 2, bad: int = 1, steps: int = 4, batch: int = 4):
    return DataLoader(Complexes(steps * batch, batch, plant, k, bad), batch_size=batch)


def make_scorer(**kw) -> PoseScorer:
    torch.manual_seed(0)
    return PoseScorer(**kw)
