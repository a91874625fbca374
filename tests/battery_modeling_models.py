"""Physics-informed battery models as state-of-charge / degradation code writes them in torch,
for ``test_battery_modeling``.

``CellModel`` is a hybrid equivalent-circuit model over padded per-cell sequences
``(B, T)``: dt from the timestamps, coulomb counting ``SOC = SOC0 - cumsum(I dt) / Q``, an
open-circuit-voltage MLP over SOC squashed into a voltage window by a sigmoid, an ohmic
resistance with an Arrhenius temperature factor, one RC pair integrated by explicit Euler,
a power-law capacity fade ``Q = Q_nom (1 - a N^z)``, and an LSTM that corrects the physics
model's residual from features of the record (current, its rate dI/dt, SOC, temperature).
The flags switch on what some codebases add, each with its domain's failure:

- ``nernst``: a Nernst-type OCV term ``k log(SOC / (1 - SOC))`` with SOC clamped to [0, 1]
  (log 0 at a full discharge);
- ``fade_rate``: the fade rate ``dQ/dN = a z N^(z-1)`` as an LSTM feature (a pole at cycle 0
  for the square-root law's ``z - 1 < 0``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

R_GAS = 8.314  # J / (mol K)
T_REF = 298.15  # K


class OCVNet(nn.Module):
    """OCV(SOC): a small MLP over SOC in (0, 1), squashed into [3.0, 4.2] V by a sigmoid."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, soc):
        return 3.0 + 1.2 * torch.sigmoid(self.net(soc.unsqueeze(-1))).squeeze(-1)


class Thermal(nn.Module):
    """Ohmic resistance R0(T) = R_ref exp(Ea/R (1/T - 1/T_ref)), T in Kelvin."""

    def __init__(self):
        super().__init__()
        self.log_r_ref = nn.Parameter(torch.tensor(math.log(0.02)))
        self.log_ea = nn.Parameter(torch.tensor(math.log(20000.0)))

    def forward(self, temp_k):
        inv_t = 1.0 / temp_k  # the bug: a record logged in Celsius reads 0 at 0 degC
        arrhenius = torch.exp(self.log_ea.exp() / R_GAS * (inv_t - 1.0 / T_REF))
        return self.log_r_ref.exp() * arrhenius


class Residual(nn.Module):
    """The LSTM correcting the physics model's voltage from the record's features."""

    def __init__(self, features: int, hidden: int = 16):
        super().__init__()
        self.lstm = nn.LSTM(features, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 1)

    def forward(self, feats, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(feats, lengths.cpu(), batch_first=True,
                                                   enforce_sorted=False)
        out, _ = self.lstm(packed)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True,
                                                  total_length=feats.shape[1])
        return 0.05 * self.head(out).squeeze(-1)


class CellModel(nn.Module):
    def __init__(self, nernst: bool = False, fade_rate: bool = False):
        super().__init__()
        self.ocv, self.thermal = OCVNet(), Thermal()
        self.nernst, self.fade_rate = nernst, fade_rate
        self.log_r1 = nn.Parameter(torch.tensor(math.log(0.015)))
        self.log_c1 = nn.Parameter(torch.tensor(math.log(2000.0)))
        self.log_a = nn.Parameter(torch.tensor(math.log(2e-3)))
        self.z = nn.Parameter(torch.tensor(0.5))  # the square-root law of SEI growth
        self.k_nernst = nn.Parameter(torch.tensor(0.01))
        self.residual = Residual(5 if fade_rate else 4)

    def capacity(self, q_nominal, cycles):
        fade = self.log_a.exp() * cycles.pow(self.z)
        return q_nominal * (1 - fade)  # Ah

    def forward(self, current, temp_k, time, q_nominal, cycles, soc0, mask):
        """current (B, T) in A (discharge positive), temp_k (B, T), time (B, T) in s,
        q_nominal (B,) Ah from the cell's metadata, cycles (B,), soc0 (B,), mask (B, T)."""
        dt = F.pad(torch.diff(time, dim=1), (1, 0)) * mask  # padding past the end: dt 0
        q = self.capacity(q_nominal, cycles)
        soc = soc0[:, None] - torch.cumsum(current * dt, dim=1) / 3600.0 / q[:, None]
        soc = soc.clamp(0.0, 1.0)
        ocv = self.ocv(soc)
        if self.nernst:
            ocv = ocv + self.k_nernst * torch.log(soc / (1 - soc))  # the bug: SOC 0 at empty
        r0 = self.thermal(temp_k)
        tau, c1 = self.log_r1.exp() * self.log_c1.exp(), self.log_c1.exp()
        v_rc, v_rcs = torch.zeros_like(soc0), []
        for t in range(current.shape[1]):  # explicit Euler of dV1/dt = -V1/(R1 C1) + I/C1
            v_rc = v_rc + dt[:, t] * (-v_rc / tau + current[:, t] / c1)
            v_rcs.append(v_rc)
        v_phys = ocv - current * r0 - torch.stack(v_rcs, 1)
        rate = F.pad(torch.diff(current, dim=1) / torch.diff(time, dim=1), (1, 0))  # dI/dt
        feats = [current / 5.0, rate, soc, (temp_k - T_REF) / 10.0]
        if self.fade_rate:
            d_fade = self.log_a.exp() * self.z * cycles.pow(self.z - 1)  # dQ/dN at cycle N
            feats.append(d_fade[:, None].expand_as(soc))
        feats = torch.stack(feats, -1) * mask[..., None]
        return v_phys + self.residual(feats, mask.sum(1))


def make_cell() -> CellModel:
    torch.manual_seed(0)
    return CellModel()


def make_cell_nernst() -> CellModel:
    torch.manual_seed(0)
    return CellModel(nernst=True)


def make_cell_fade_rate() -> CellModel:
    torch.manual_seed(0)
    return CellModel(fade_rate=True)


def voltage_loss(v_pred, v_meas, mask):
    """Per-cell normalised voltage MSE over the valid steps: each cell's error in units of its
    own voltage spread, so cells of different chemistries weigh the same."""
    m = mask.to(v_meas.dtype)
    n = m.sum(1, keepdim=True)
    mean = (v_meas * m).sum(1, keepdim=True) / n
    std = (((v_meas - mean) ** 2 * m).sum(1, keepdim=True) / n).sqrt()
    z = (v_pred - v_meas) / std  # the bug: a resting cell's voltage has no spread
    return (z.pow(2) * m).sum() / m.sum()


def voltage_loss_eps(v_pred, v_meas, mask):
    m = mask.to(v_meas.dtype)
    n = m.sum(1, keepdim=True)
    mean = (v_meas * m).sum(1, keepdim=True) / n
    std = (((v_meas - mean) ** 2 * m).sum(1, keepdim=True) / n).sqrt()
    z = (v_pred - v_meas) / (std + 1e-3)
    return (z ** 2 * m).sum() / m.sum()


# ---------------------------------------------------------------------------------------------
# data: padded drive-cycle records of cells


def cell_record(g: torch.Generator, length: int, steps: int):
    """One cell's discharge under a pulsed load: current (A), temperature (K), time (s) and the
    voltage a reference ECM with a bit of noise gives."""
    t = torch.cumsum(torch.full((length,), 10.0) + torch.rand(length, generator=g), 0)
    current = 1.0 + 2.0 * (torch.rand(length, generator=g) > 0.5).float()
    temp = 293.15 + 10 * torch.rand(1, generator=g) + 0.1 * torch.arange(length)
    volts = 4.0 - 0.3 * torch.arange(length) / steps - 0.03 * current
    volts = volts + 0.005 * torch.randn(length, generator=g)
    return current, temp, t, volts


def cell_batch(g: torch.Generator, bad: int | None = None, fault: str = "", n: int = 8,
               steps: int = 12):
    """(model args, loss args) of a padded batch of ``n`` cells; ``fault`` plants one record's
    data condition in cell ``bad``."""
    lengths = steps - (torch.arange(n) % 4)
    cols = [torch.zeros(n, steps) for _ in range(4)]
    for i in range(n):
        for col, val in zip(cols, cell_record(g, int(lengths[i]), steps)):
            col[i, :lengths[i]] = val
    current, temp, time, volts = cols
    mask = torch.arange(steps)[None] < lengths[:, None]
    if fault != "zero_pad":  # pad_sequence's default 0 is 0 K: pad with room temperature
        temp = torch.where(mask, temp, T_REF)
    q_nom = 2.5 + 0.5 * torch.rand(n, generator=g)
    cycles = torch.randint(10, 500, (n,), generator=g).float()
    soc0 = 0.8 + 0.2 * torch.rand(n, generator=g)
    if fault == "celsius":  # a logger writing degC; the record starts at 0 degC
        temp[bad] = torch.where(mask[bad], temp[bad] - temp[bad, 0].item(), T_REF)
    elif fault == "celsius_warm":  # the same logger on a 25 degC day
        temp[bad] = torch.where(mask[bad], temp[bad] - 273.15, T_REF)
    elif fault == "no_capacity":  # the metadata sheet had no capacity: fillna(0)
        q_nom[bad] = 0.0
    elif fault == "repeated_time":  # a logger writing two rows per second at 1 s resolution
        time[bad, 5] = time[bad, 4]
    elif fault == "empty":  # a full discharge: the cell starts nearly empty
        soc0[bad] = 0.001
    elif fault == "fresh":  # a fresh cell: cycle 0
        cycles[bad] = 0.0
    elif fault == "resting":  # a rest period: no current, a flat voltage
        current[bad] = 0.0
        volts[bad, :lengths[bad]] = 3.75  # a BMS quantising to 5 mV
    return (current, temp, time, q_nom, cycles, soc0, mask), (volts, mask)
