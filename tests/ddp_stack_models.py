"""DistributedDataParallel training as users write it, for tests/test_ddp_stack.py.

Run as ``python -m torch.distributed.run --nproc_per_node=2 ddp_stack_models.py OUT MODE...``
(gloo, CPU): each MODE trains a fresh model under its own recorder in ``OUT/MODE`` and prints
one line per rank (``rank R MODE event step=.. phase=..`` or ``rank R MODE done ...``), also
into ``OUT/rankR.txt``.

The model is a tabular encoder with a classification head, a projection for a contrastive loss
that all-gathers every rank's embeddings (negatives from the whole world), and a pair branch
used on every other step only (``find_unused_parameters=True``). The raw features are
normalised by a batch norm whose statistics are all-reduced over the ranks: torch's
``SyncBatchNorm`` refuses CPU tensors, so CPU/gloo users write this one (sum, sum of squares
and count all-reduced; alone, without a process group, the rank's own statistics).

The loop: ``DistributedSampler`` with ``set_epoch``, a ``DataLoader`` of dict batches (features,
a missing-value mask, a domain id, a label), gradient accumulation over two micro-batches with
``model.no_sync()`` on the first, clipping, an all-reduce of the loss for logging, a checkpoint
written by rank 0 at each epoch's end, and (mode ``join``) uneven inputs under ``Join``.
"""

from __future__ import annotations

import hashlib
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

N_FEATURES, N_DOMAINS, N_CLASSES, HIDDEN, EMB = 10, 6, 3, 16, 8
ROWS, MICRO, ACCUM, EPOCHS = 64, 4, 2, 2


class AllReduceBatchNorm(nn.Module):
    """Batch norm over the whole world's batch: statistics all-reduced when a process group is
    up (the replay's single process uses the rank's own)."""

    def __init__(self, n: int, eps: float = 1e-5, momentum: float = 0.1):
        super().__init__()
        self.eps, self.momentum = eps, momentum
        self.sync = True  # False: the rank's own statistics (uneven inputs under Join)
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n))
        self.register_buffer("running_mean", torch.zeros(n))
        self.register_buffer("running_var", torch.ones(n))

    def forward(self, x):
        if not self.training:
            mean, var = self.running_mean, self.running_var
        else:
            stats = torch.cat([x.sum(0), (x * x).sum(0), x.new_tensor([x.shape[0]])])
            if self.sync and dist.is_available() and dist.is_initialized():
                stats = _AllReduce.apply(stats)
            n = stats[-1]
            mean = stats[:x.shape[1]] / n
            var = stats[x.shape[1]:-1] / n - mean * mean  # LINE one-pass variance
            with torch.no_grad():
                self.running_mean.lerp_(mean, self.momentum)
                self.running_var.lerp_(var * n / (n - 1), self.momentum)
        return (x - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias  # LINE bn


class _AllReduce(torch.autograd.Function):
    """Sum over the ranks, whose backward sums the gradients too (every rank's rows used the
    world's statistics)."""

    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g)
        return g


class TabularEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = AllReduceBatchNorm(N_FEATURES)
        self.domain = nn.Embedding(N_DOMAINS, 4)
        self.body = nn.Sequential(nn.Linear(N_FEATURES + 4, HIDDEN), nn.GELU(),
                                  nn.Linear(HIDDEN, HIDDEN), nn.GELU())
        self.head = nn.Linear(HIDDEN, N_CLASSES)
        self.proj = nn.Linear(HIDDEN, EMB)
        self.pair = nn.Linear(HIDDEN, 4)  # the pair branch: not used on every step

    def encode(self, x, mask, domain):
        x = self.norm(x).masked_fill(~mask, 0.0)  # missing values: 0 after normalising
        return self.body(torch.cat([x, self.domain(domain)], dim=-1))

    def forward(self, x, mask, domain, partner=None):
        h = self.encode(x, mask, domain)
        z = self.proj(h)
        z = z / z.norm(dim=-1, keepdim=True).clamp_min(1e-6)
        if partner is None:
            return self.head(h), z
        e = self.pair(h)  # each row's partner: the index of another row of the batch
        gap = (e - e[partner]).pow(2).sum(-1).sqrt()  # LINE pair distance
        return self.head(h), z, gap


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return TabularEncoder()


class ContrastiveLoss(nn.Module):
    """Cross-entropy on the labels plus an InfoNCE over every rank's embeddings (all-gathered,
    this rank's own slot keeping its gradient) with a hand-stabilised softmax; a margin on the
    pair branch's distance when the step uses it."""

    def __init__(self, temperature: float = 0.1, weight: float = 0.5):
        super().__init__()
        self.temperature, self.weight = temperature, weight

    def gather(self, z):
        if not (dist.is_available() and dist.is_initialized()):
            return z, 0
        parts = [torch.empty_like(z) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, z.detach())
        parts[dist.get_rank()] = z
        return torch.cat(parts), dist.get_rank() * z.shape[0]

    def forward(self, out, y):
        logits, z = out[0], out[1]
        everyone, offset = self.gather(z)
        sim = z @ everyone.t() / self.temperature
        sim = sim - sim.max(dim=1, keepdim=True).values.detach()
        p = sim.exp() / sim.exp().sum(dim=1, keepdim=True)
        own = torch.arange(z.shape[0]) + offset
        # positives: the same label's other rows of this rank (hand-written InfoNCE)
        same = (y[:, None] == y[None, :]).float() - torch.eye(len(y))
        pos = p[:, own[0]:own[0] + len(y)]
        nce = -(torch.log(pos) * same).sum() / same.sum().clamp_min(1.0)  # LINE log p
        loss = F.cross_entropy(logits, y) + self.weight * nce
        if len(out) == 3:
            loss = loss + F.relu(1.0 - out[2]).mean()
        return loss


class _ClassLoss(nn.Module):
    """Cross-entropy on the head's logits (a loss without collectives: ``Join`` shadows DDP's
    all-reduce only)."""

    def forward(self, out, y):
        return F.cross_entropy(out[0], y)


class Rows(Dataset):
    """A table of rows: features (one of them a raw reading around ``offset``), a missing-value
    mask, a domain id and a class. ``bad`` marks row indices whose feature 3 is NaN (a corrupt
    shard)."""

    def __init__(self, n: int = ROWS, seed: int = 0, offset: float = 0.0, domains: int = 4,
                 bad: tuple[int, ...] = ()):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, N_FEATURES, generator=g)
        self.x[:, 0] = self.x[:, 0] * 0.01 + offset
        self.mask = torch.rand(n, N_FEATURES, generator=g) > 0.1
        self.domain = torch.randint(0, domains, (n,), generator=g)
        self.y = torch.randint(0, N_CLASSES, (n,), generator=g)
        for i in bad:
            self.x[i, 3] = float("nan")

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "mask": self.mask[i], "domain": self.domain[i], "y": self.y[i]}


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _forward(ddp, batch, step):
    partner = None
    if step % 2 == 1 and not ddp.static_graph:  # the pair branch: every other step (find_unused_parameters=True)
        n = len(batch["y"])
        partner = batch.get("partner", (torch.arange(n) + 1) % n)
    return ddp(batch["x"], batch["mask"], batch["domain"], partner)


def train(ddp, opt, crit, loader, sampler, rank, mode, out_dir, steps=None):
    """The epoch loop; returns the number of optimizer steps taken."""
    step = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        batches = list(loader)
        for i in range(0, len(batches), ACCUM):
            micro = batches[i:i + ACCUM]
            opt.zero_grad()
            total = torch.zeros(())
            for j, batch in enumerate(micro):
                plant(mode, rank, step, j, batch, crit)
                last = j == len(micro) - 1
                # (static_graph's first step may not run under no_sync: torch asserts)
                with (ddp.no_sync() if not last and not ddp.static_graph else _nothing()):
                    loss = crit(_forward(ddp, batch, step), batch["y"]) / len(micro)
                    loss.backward()
                total += loss.detach()
            nn.utils.clip_grad_norm_(ddp.parameters(), 5.0)
            opt.step()
            dist.all_reduce(total)  # the logged loss: the world's mean
            step += 1
            if steps is not None and step >= steps:
                return step
        if rank == 0:  # checkpoint on rank 0
            torch.save({"model": ddp.module.state_dict(), "epoch": epoch},
                       os.path.join(out_dir, "last.pt"))
        dist.barrier()
    return step


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def plant(mode, rank, step, micro, batch, crit):
    """The planted failures that live in the loop rather than the data."""
    if mode == "pair" and rank == 0 and step == 3 and micro == 1:
        n = len(batch["y"])
        batch["partner"] = (torch.arange(n) + 1) % n
        batch["partner"][2] = 2  # a row paired with itself: distance exactly 0
    if mode == "temperature" and step == 2 and micro == 0:
        crit.temperature = 1e-4  # an annealing schedule that went too far


def build(mode: str):
    model = make_model()
    if mode == "static":  # the same parameters every step: static_graph, no pair branch
        ddp = nn.parallel.DistributedDataParallel(model, static_graph=True)
    else:
        ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    eps = 0.0 if mode == "adam" else 1e-8
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, eps=eps)
    return model, ddp, opt


def dataset(mode: str, rank: int) -> Rows:
    offset = 3000.0 if mode == "cancel" else 0.0
    domains = N_DOMAINS if mode != "adam" else 4  # ids 4 and 5 never seen
    bad = ()
    if mode == "shard" and rank == 1:  # rank 1's copy of the shard is corrupt
        order = list(DistributedSampler(range(ROWS), num_replicas=2, rank=1, seed=0))
        bad = (order[2 * ACCUM * MICRO + 1],)  # step 2, micro-batch 0, row 1
    return Rows(offset=offset, domains=domains, bad=bad)


def train_uneven(ddp, opt, crit, rank, bad=False):
    """Uneven inputs: rank 0 holds more rows than rank 1; ``Join`` shadows the collectives of
    the rank that ran out (DDP's gradient all-reduce) until every rank is done."""
    from torch.distributed.algorithms.join import Join

    data = Rows()
    part = torch.utils.data.Subset(data, range(0, 40) if rank == 0 else range(40, 64))
    steps = 0
    with Join([ddp]):  # (as without the recorder: it shadows its own collective there)
        for batch in DataLoader(part, batch_size=MICRO):
            if bad and rank == 0 and steps == 8:  # past rank 1's last batch
                batch["x"][3, 5] = float("inf")
            opt.zero_grad()
            crit(ddp(batch["x"], batch["mask"], batch["domain"]), batch["y"]).backward()
            opt.step()
            steps += 1
    return steps


def run_mode(out: str, mode: str, record: bool) -> str:
    from recorder import FlightRecorder, NonFiniteError

    rank, world = dist.get_rank(), dist.get_world_size()
    out_dir = os.path.join(out, mode + ("" if record else "-bare"))
    os.makedirs(out_dir, exist_ok=True)
    model, ddp, opt = build(mode)
    data = dataset(mode, rank)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=0)
    loader = DataLoader(data, batch_size=MICRO, sampler=sampler)
    crit = ContrastiveLoss()
    if mode == "joininnerguard":  # (the same, the Join entered before the recorder)
        from torch.distributed.algorithms.join import Join
        try:
            with Join([ddp]), FlightRecorder(ddp, opt, loss_fn=_ClassLoss(), out_dir=out_dir,
                                             guard_optimizer=True):
                return "not refused"
        except ValueError as e:
            return f"refused {e}"
    if mode == "joinguard":  # (guard_optimizer's second read per step: Join refused)
        try:
            with FlightRecorder(ddp, opt, loss_fn=_ClassLoss(), out_dir=out_dir,
                                guard_optimizer=True):
                train_uneven(ddp, opt, _ClassLoss(), rank)
        except ValueError as e:
            return f"refused {e}"
        return "not refused"
    if mode in ("join", "joinbad", "joinwarn"):
        crit = _ClassLoss()
        model.norm.sync = False  # Join shadows DDP's collectives only
        if not record:
            return f"done steps={train_uneven(ddp, opt, crit, rank)} digest={digest(model)}"
        try:
            with FlightRecorder(ddp, opt, loss_fn=crit, out_dir=out_dir,
                                factory="ddp_stack_models:make_model",
                                on_event="warn" if mode == "joinwarn" else "raise"):
                steps = train_uneven(ddp, opt, crit, rank, bad=mode != "join")
            return f"done steps={steps} digest={digest(model)}"
        except NonFiniteError as e:
            return f"event step={e.event['step']} phase={e.event['phase']}"
    if not record:
        steps = train(ddp, opt, crit, loader, sampler, rank, mode, out_dir)
        return f"done steps={steps} digest={digest(model)}"
    try:
        with FlightRecorder(ddp, opt, loss_fn=crit, out_dir=out_dir,
                            factory="ddp_stack_models:make_model"):
            steps = train(ddp, opt, crit, loader, sampler, rank, mode, out_dir)
        return f"done steps={steps} digest={digest(model)}"
    except NonFiniteError as e:
        ev = e.event
        return (f"event step={ev['step']} phase={ev['phase']} first={ev['ranks']['first']} "
                f"bundle={os.path.basename(str(e.bundle_path))}")


def main(out: str, *modes: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    try:
        for mode in modes:
            record = not mode.endswith("-bare")
            name = mode.removesuffix("-bare")
            said = f"rank {rank} {mode} {run_mode(out, name, record)}"
            print(said, flush=True)
            with open(os.path.join(out, f"rank{rank}.txt"), "a") as f:  # (the ranks' prints
                f.write(said + "\n")  # may run into each other)
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # (leave before DDP's teardown, as tests/dist/ddp_train.py does)


if __name__ == "__main__":
    main(*sys.argv[1:])
