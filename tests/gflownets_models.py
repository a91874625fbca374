"""GFlowNets on torchgfn's hypergrid, written as torchgfn and the reference implementations
(Malkin et al.'s trajectory balance tutorial, Bengio et al.'s flow-matching code) write them,
for ``test_gflownets``.

- The environment in torch: a ``H ** D`` grid, a state is its coordinates, an action increments
  one coordinate or stops; the forward mask forbids stepping off the grid, the backward mask
  forbids decrementing a 0. The reward is torchgfn's hypergrid reward
  ``R0 + R1 * prod(0.25 < |x / (H - 1) - 0.5|) + R2 * prod(0.3 < |...| < 0.4)`` (``R0 = 0``:
  the "hard" grid, where most of the grid has reward exactly 0).
- ``OnPolicyTB``: trajectory balance with a learned ``log Z``; ``forward`` samples a batch of
  trajectories from the start state, a forward and a backward policy MLP (logits of invalid
  actions filled with ``-inf`` before ``log_softmax``), epsilon-uniform exploration mixed in
  probability space, the log-probabilities of the actions taken summed along the trajectory
  (the tutorial's rollout with gradients on). The loss takes the log reward of the terminal
  states: ``(log Z + sum log PF - log R(x) - sum log PB) ** 2``.
- ``BufferDB``: detailed balance with a state-flow head over trajectories from a replay buffer,
  padded to the longest with a padding mask (the sink state after ``stop``: every forward action
  masked), the per-step terms summed with the mask.
- ``FlowMatching``: Bengio et al.'s flow-matching condition with edge flows, the in-flow a
  logsumexp over the masked parents' edges, the out-flow over the children and the reward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

H, D = 4, 2
N_ACTIONS = D + 1  # increment a coordinate, or stop
MAX_LEN = D * (H - 1) + 1


def hypergrid_reward(x: torch.Tensor, r0: float) -> torch.Tensor:
    """torchgfn's ``HyperGrid.reward`` (``R0 = 0`` makes every state off the modes worth 0)."""
    ax = (x / (H - 1) - 0.5).abs()
    r1 = ((ax > 0.25).prod(-1)).float()
    r2 = ((ax > 0.3) & (ax < 0.4)).prod(-1).float()
    return r0 + 0.5 * r1 + 2.0 * r2


def forward_mask(s: torch.Tensor) -> torch.Tensor:
    """Which actions are valid from ``s``: an increment below the edge, and stop."""
    return torch.cat([s < H - 1, torch.ones_like(s[:, :1], dtype=torch.bool)], dim=-1)


def backward_mask(s: torch.Tensor) -> torch.Tensor:
    """Which parents ``s`` has: a decrement of each coordinate above 0."""
    return s > 0


def preprocess(s: torch.Tensor) -> torch.Tensor:
    """torchgfn's identity preprocessor, centred: coordinates in [-1, 1]."""
    return s.float() / (H - 1) * 2 - 1


def mlp(n_in: int, n_out: int, hidden: int = 32) -> nn.Sequential:
    return nn.Sequential(nn.Linear(n_in, hidden), nn.LeakyReLU(), nn.Linear(hidden, hidden),
                         nn.LeakyReLU(), nn.Linear(hidden, n_out))


class OnPolicyTB(nn.Module):
    """Trajectory balance: samples ``len(s0)`` trajectories with epsilon-uniform exploration
    and returns ``(log Z, sum log PF, sum log PB, terminal states)``. ``uniform_over_all``: the
    exploration's uniform part spread over every action, valid or not (the bug)."""

    def __init__(self, epsilon: float = 0.1, uniform_over_all: bool = False):
        super().__init__()
        self.pf, self.pb = mlp(D, N_ACTIONS), mlp(D, D)
        self.log_z = nn.Parameter(torch.zeros(1))
        self.epsilon, self.uniform_over_all = epsilon, uniform_over_all

    def explore(self, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The action drawn from ``(1 - eps) * PF + eps * uniform`` (no gradient)."""
        with torch.no_grad():
            probs = logits.softmax(-1)
            valid = torch.ones_like(mask) if self.uniform_over_all else mask
            uniform = valid.float() / valid.sum(-1, keepdim=True)
            mixed = (1 - self.epsilon) * probs + self.epsilon * uniform
            return torch.multinomial(mixed, 1).squeeze(-1)

    def forward(self, s0: torch.Tensor):
        s, done = s0.clone(), torch.zeros(len(s0), dtype=torch.bool)
        log_pf, log_pb = torch.zeros(len(s0)), torch.zeros(len(s0))
        for _ in range(MAX_LEN):
            if done.all():
                break
            mask = forward_mask(s)
            logits = self.pf(preprocess(s)).masked_fill(~mask, float("-inf"))
            act = self.explore(logits, mask) if self.training else logits.argmax(-1)
            lp = logits.log_softmax(-1).gather(-1, act[:, None]).squeeze(-1)
            log_pf = log_pf + torch.where(done, 0.0, lp)
            stop = act == D
            step = F.one_hot(act.clamp(max=D - 1), D) * (~stop & ~done)[:, None]
            nxt = s + step
            moved = ~stop & ~done
            b_logits = self.pb(preprocess(nxt)).masked_fill(~backward_mask(nxt), float("-inf"))
            lb = b_logits.log_softmax(-1).gather(-1, act.clamp(max=D - 1)[:, None]).squeeze(-1)
            log_pb = log_pb + torch.where(moved, lb, 0.0)
            s, done = nxt, done | stop
        return self.log_z.expand(len(s0)), log_pf, log_pb, s


class TBLoss(nn.Module):
    """Trajectory balance's squared log-ratio, the log reward of each terminal state;
    ``clip_min``: torchgfn's ``log_reward_clip_min`` (a reward of 0 counts as ``clip_min``)."""

    def __init__(self, r0: float = 1e-3, clip_min: float | None = None):
        super().__init__()
        self.r0, self.clip_min = r0, clip_min

    def forward(self, log_z, log_pf, log_pb, x):
        log_r = torch.log(hypergrid_reward(x, self.r0))
        if self.clip_min is not None:
            log_r = log_r.clamp(min=self.clip_min)
        return (log_z + log_pf - log_r - log_pb).pow(2).mean()


def make_tb() -> nn.Module:
    torch.manual_seed(0)
    return OnPolicyTB()


def make_tb_uniform_over_all() -> nn.Module:
    torch.manual_seed(0)
    return OnPolicyTB(uniform_over_all=True)


# ---------------------------------------------------------------------------------------------
# Detailed balance over padded trajectories from a replay buffer


def rollout(g: torch.Generator, n: int) -> list[torch.Tensor]:
    """``n`` uniformly random trajectories' states, each ending with its terminal state."""
    out = []
    for _ in range(n):
        s, states = torch.zeros(D, dtype=torch.long), []
        while True:
            states.append(s.clone())
            valid = forward_mask(s[None])[0].nonzero().flatten()
            a = valid[torch.randint(len(valid), (1,), generator=g)].item()
            if a == D:
                break
            s[a] += 1
        out.append(torch.stack(states))
    return out


def pad_trajectories(trajs: list[torch.Tensor]):
    """States ``(B, T + 1, D)`` padded with the terminal state (the sink), actions ``(B, T)``
    (``stop`` on padding), the padding mask ``(B, T)``."""
    t = max(len(tr) for tr in trajs)
    states = torch.stack([torch.cat([tr, tr[-1:].expand(t + 1 - len(tr), D)]) for tr in trajs])
    diff = states[:, 1:] - states[:, :-1]
    actions = torch.where(diff.any(-1), diff.argmax(-1), D)
    pad = torch.arange(t)[None] < torch.tensor([len(tr) for tr in trajs])[:, None]
    return states, actions, pad


class BufferDB(nn.Module):
    """Detailed balance with a state-flow head: per transition
    ``log F(s) + log PF(a|s) - log F(s') - log PB(s|s')``, ``log F`` of a terminal state its log
    reward (given), summed over the valid steps with the padding mask. ``sink``: the padding's
    sink state has every forward action masked (torchgfn's ``s_f``), its ``log_softmax`` row all
    ``-inf``; else padding keeps the terminal state's mask. ``where_pad``: the padded steps'
    terms replaced with ``torch.where``; else multiplied by the mask."""

    def __init__(self, sink: bool = True, where_pad: bool = False):
        super().__init__()
        self.pf, self.pb, self.flow = mlp(D, N_ACTIONS), mlp(D, D), mlp(D, 1)
        self.sink, self.where_pad = sink, where_pad

    def forward(self, states, actions, pad, log_r):
        s, nxt = states[:, :-1], states[:, 1:]
        stop = actions == D
        f_mask = forward_mask(s.reshape(-1, D)).view(*s.shape[:2], N_ACTIONS)
        if self.sink:  # a stopped trajectory's padding sits in the sink: no valid action
            f_mask = f_mask & pad[..., None]
        logits = self.pf(preprocess(s)).masked_fill(~f_mask, float("-inf"))
        lpf = logits.log_softmax(-1).gather(-1, actions[..., None]).squeeze(-1)
        b_logits = self.pb(preprocess(nxt)).masked_fill(~backward_mask(nxt), float("-inf"))
        lpb = b_logits.log_softmax(-1).gather(-1, actions.clamp(max=D - 1)[..., None])
        lpb = torch.where(stop, 0.0, lpb.squeeze(-1))
        log_f = self.flow(preprocess(s)).squeeze(-1)
        log_f_next = torch.where(stop, log_r[:, None], self.flow(preprocess(nxt)).squeeze(-1))
        delta = log_f + lpf - log_f_next - lpb
        if self.where_pad:
            return torch.where(pad, delta, 0.0)
        return delta * pad


def db_loss(delta, pad):
    return delta.pow(2).sum() / pad.sum()


def make_db() -> nn.Module:
    torch.manual_seed(0)
    return BufferDB()


def make_db_where() -> nn.Module:
    torch.manual_seed(0)
    return BufferDB(where_pad=True)


def make_db_healthy() -> nn.Module:
    torch.manual_seed(0)
    return BufferDB(sink=False, where_pad=True)


# ---------------------------------------------------------------------------------------------
# Flow matching (Bengio et al. 2021): in-flow equals out-flow at every visited state


class FlowMatching(nn.Module):
    """Edge flows ``log F(s -> s + e_i)`` from one head; a state's in-flow is the logsumexp
    over its parents' edges into it (a coordinate at 0 has no parent there: -inf), its
    out-flow the logsumexp over its children and its reward (every state can stop). Returns
    ``(log in-flow, log out-flow)`` of the states given (not the start state, which has no
    parent)."""

    def __init__(self):
        super().__init__()
        self.edge = mlp(D, D)

    def forward(self, s: torch.Tensor, log_r: torch.Tensor):
        eye = torch.eye(D, dtype=torch.long)
        parents = s[:, None, :] - eye  # parent i: one step back along coordinate i
        into = self.edge(preprocess(parents)).diagonal(dim1=1, dim2=2)  # F(parent_i -> s)
        log_in = into.masked_fill(~backward_mask(s), float("-inf")).logsumexp(-1)
        out = self.edge(preprocess(s)).masked_fill(~forward_mask(s)[:, :D], float("-inf"))
        log_out = torch.cat([out, log_r[:, None]], -1).logsumexp(-1)
        return log_in, log_out


def fm_loss(log_in, log_out):
    return (log_in - log_out).pow(2).mean()


def visited_states(trajs: list[torch.Tensor], with_start: bool) -> torch.Tensor:
    """Every state the trajectories visit, the start state only when ``with_start`` (the
    reference code's loop from ``t = 1``; from 0: the bug)."""
    return torch.cat([tr[0 if with_start else 1:] for tr in trajs])


def make_fm() -> nn.Module:
    torch.manual_seed(0)
    return FlowMatching()
