"""Machine learning for electric power systems as grid code writes it in torch, for
``test_power_systems``.

``GridGNN`` is a physics-informed state estimator / OPF proxy on a 6-bus bus-branch network:
per-bus load features (P, Q in per-unit on a 100 MVA base, SCADA readings with an
``observed`` mask) standardised by the training set's load statistics (buffers), a bus-type
embedding, two graph convolutions over the grid topology, and a head squashing the voltage
magnitude into [0.94, 1.06] p.u. by a sigmoid and the angle by a tanh (slack angle 0). Each
operating point carries its own branch data ``r, x`` (p.u.) and line status (N-1
contingencies): the admittance matrix ``Y = A^T diag(status / (r + jx)) A`` is built per
sample, the injections are ``S = V conj(Y V)`` and ``LineFlows`` gives each branch's apparent
power ``|S_ij| = sqrt(P^2 + Q^2)``. ``OPFLoss`` mixes an MSE on the voltages with the
power-flow residual, a ReLU penalty on line flows over their rating and, optionally, a
log-barrier ``-mu log(S_max - |S_ij|)`` keeping the flows inside the (dynamic) ratings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

LINES = [(0, 1), (0, 2), (1, 2), (1, 3), (2, 4), (3, 4), (3, 5), (4, 5)]
N_BUS = 6
BUS_TYPE = [2, 1, 0, 0, 0, 0]  # slack, PV, PQ...; type 3 (storage) has no bus on this grid
R_BASE = torch.tensor([0.02, 0.03, 0.025, 0.04, 0.02, 0.03, 0.05, 0.035])
X_BASE = torch.tensor([0.10, 0.12, 0.09, 0.15, 0.08, 0.11, 0.18, 0.12])
P_GEN = 0.6  # the PV unit's dispatch, p.u.


def incidence() -> torch.Tensor:
    a = torch.zeros(len(LINES), N_BUS)
    for k, (f, t) in enumerate(LINES):
        a[k, f], a[k, t] = 1.0, -1.0
    return a


def load_profile(g: torch.Generator, n: int, transit: int | None = None) -> torch.Tensor:
    """``(n, N_BUS, 2)`` bus loads (P, Q) in p.u. (the generator buses' station load too); a
    ``transit`` bus (a zero-injection substation) draws nothing."""
    p = 0.1 + 0.4 * torch.rand(n, N_BUS, generator=g)
    load = torch.stack([p, 0.3 * p + 0.02 * torch.rand(n, N_BUS, generator=g)], -1)
    if transit is not None:
        load[:, transit] = 0.0
    return load


class GraphConv(nn.Module):
    """h' = relu(W h + U (D^-1/2 A D^-1/2) h), the grid's normalised adjacency."""

    def __init__(self, hidden: int):
        super().__init__()
        self.self_lin, self.neigh_lin = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, h, adj):
        return F.relu(self.self_lin(h) + self.neigh_lin(adj @ h))


class LineFlows(nn.Module):
    """Apparent power at each branch's from end, |S_ij| = sqrt(P^2 + Q^2)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("f_bus", torch.tensor([f for f, _ in LINES]))
        self.register_buffer("t_bus", torch.tensor([t for _, t in LINES]))

    def forward(self, v, y):
        vf, vt = v[:, self.f_bus], v[:, self.t_bus]
        s = vf * torch.conj(y * (vf - vt))
        return torch.sqrt(s.real ** 2 + s.imag ** 2)


class GridGNN(nn.Module):
    def __init__(self, load_mean, load_std, hidden: int = 16, vmin: float = 0.94,
                 vmax: float = 1.06):
        super().__init__()
        a = incidence()
        adj = (a.T @ a).abs().fill_diagonal_(0.0)
        deg = adj.sum(1).rsqrt()
        self.register_buffer("inc", a)
        self.register_buffer("adj", deg[:, None] * adj * deg[None])
        self.register_buffer("bus_type", torch.tensor(BUS_TYPE))
        self.register_buffer("load_mean", load_mean)
        self.register_buffer("load_std", load_std)
        self.vmin, self.vmax = vmin, vmax
        self.inp = nn.Linear(2, hidden)
        self.type_emb = nn.Embedding(4, hidden)
        self.convs = nn.ModuleList([GraphConv(hidden) for _ in range(2)])
        self.head = nn.Linear(hidden, 2)
        self.flows = LineFlows()

    def admittance(self, r, x, status):
        y = status / torch.complex(r, x)  # series admittance of each branch, per sample
        a = self.inc.to(y.dtype)
        return a.T @ (y[..., None] * a), y

    def forward(self, load, observed, r, x, status):
        """load (B, N, 2) p.u. (0 where a reading is missing), observed (B, N) bool,
        r, x, status (B, L): each operating point's branch data."""
        z = (load - self.load_mean) / self.load_std
        z = torch.where(observed[..., None], z, 0.0).to(self.inp.weight.dtype)  # missing: mean
        h = self.inp(z) + self.type_emb(self.bus_type)
        for conv in self.convs:
            h = conv(h, self.adj)
        out = self.head(h).float()
        vm = self.vmin + (self.vmax - self.vmin) * torch.sigmoid(out[..., 0])
        va = 0.2 * torch.tanh(out[..., 1]) * (self.bus_type != 2)
        big_y, y = self.admittance(r, x, status)
        v = torch.polar(vm, va)
        s = v * torch.conj((big_y @ v[..., None]).squeeze(-1))
        return vm, va, s.real, s.imag, self.flows(v, y)


def statistics(transit: int | None = None, n: int = 256):
    """The load statistics of a training set (per bus and quantity), as the model's buffers."""
    load = load_profile(torch.Generator().manual_seed(123), n, transit)
    return load.mean(0), load.std(0)


def make_gnn() -> GridGNN:
    torch.manual_seed(0)
    return GridGNN(*statistics())


def make_gnn_transit() -> GridGNN:
    """A grid with a zero-injection substation at bus 3, standardised without a floor."""
    torch.manual_seed(0)
    return GridGNN(*statistics(transit=3))


def make_gnn_half() -> GridGNN:
    return make_gnn().half()


class OPFLoss(nn.Module):
    """MSE on |V| and theta, the power-flow residual at the non-slack buses, a ReLU penalty on
    line flows over their rating and, with ``mu``, a log-barrier on the ratings."""

    def __init__(self, w_pf: float = 0.1, w_line: float = 1.0, mu: float = 0.0):
        super().__init__()
        self.w_pf, self.w_line, self.mu = w_pf, w_line, mu

    def forward(self, out, vm_t, va_t, p_inj, q_inj, rating):
        vm, va, p, q, flow = out
        mse = F.mse_loss(vm, vm_t) + F.mse_loss(va, va_t)
        pf = ((p - p_inj) ** 2 + (q - q_inj) ** 2)[:, 1:].mean()
        line = F.relu(flow - rating).pow(2).mean()
        loss = mse + self.w_pf * pf + self.w_line * line
        if self.mu:
            loss = loss - self.mu * torch.log(rating - flow).mean()
        return loss


def make_barrier_loss() -> OPFLoss:
    return OPFLoss(mu=1e-3)


# ---------------------------------------------------------------------------------------------
# data: operating points with a linearised power-flow solution as the label


class OperatingPoints(torch.utils.data.Dataset):
    """Operating points of the 6-bus grid: SCADA loads with dropped readings, branch data, DLR
    ratings and the voltages a linearised (DC + reactive) power flow gives."""

    def __init__(self, n: int, seed: int, transit: int | None = None):
        g = torch.Generator().manual_seed(seed)
        self.load = load_profile(g, n, transit)
        self.observed = torch.rand(n, N_BUS, generator=g) > 0.1
        self.load = self.load * self.observed[..., None]  # fillna(0) where a reading is missing
        self.r = R_BASE * (1 + 0.05 * torch.rand(n, len(LINES), generator=g))
        self.x = X_BASE.expand(n, -1).clone()
        self.status = torch.ones(n, len(LINES))
        self.rating = 3.0 + torch.rand(n, len(LINES), generator=g)
        p_inj, q_inj = -self.load[..., 0], -self.load[..., 1]
        p_inj[:, 1] += P_GEN
        a = incidence()
        b = a.T @ (a / X_BASE[:, None])
        va = torch.zeros(n, N_BUS)
        va[:, 1:] = torch.linalg.solve(b[1:, 1:], p_inj[:, 1:].T).T
        vm = 1.0 + 0.1 * F.pad(torch.linalg.solve(b[1:, 1:], q_inj[:, 1:].T).T, (1, 0))
        self.targets = (vm.clamp(0.95, 1.05), va, p_inj, q_inj)

    def __len__(self):
        return len(self.load)

    def __getitem__(self, i):
        args = (self.load[i], self.observed[i], self.r[i], self.x[i], self.status[i])
        return args, tuple(t[i] for t in self.targets) + (self.rating[i],)


def plant(args, targets, fault: str, bad: int):
    """One operating point's data condition, in sample ``bad`` of a batch."""
    load, observed, r, x, status = args
    if fault == "nan_reading":  # a reading the RTU sent as NaN with a good quality flag
        load[bad, 4, 0] = float("nan")
        observed[bad, 4] = True
    elif fault == "bus_tie":  # a switching action closes a bus coupler: a zero-impedance branch
        r[bad, 2], x[bad, 2] = 0.0, 0.0
    elif fault == "outage":  # an N-1 contingency: branch 5 out of service
        status[bad, 5] = 0.0
    elif fault == "no_rating":  # the DLR feed had no rating for a line: fillna(0)
        targets[4][bad, 3] = 0.0
    elif fault == "kilowatt":  # a feeder's RTU reporting kW, not p.u. on a 100 MVA base
        load[bad, 5] = load[bad, 5] * 1e5
    return args, targets
