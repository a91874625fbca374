"""Tensor parallelism on two CPU ranks (torchrun, gloo), as PyTorch's TP tutorial and
torchtitan write it: ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` /
``SequenceParallel`` on a one-dimensional ``init_device_mesh("cpu", (2,))``. Run as modes of
the launch of tests/test_torchrun.py's ``sharded`` fixture (see tests/dist/modes.py).

Modes: ``bare`` (no recorder) and ``healthy`` print each step's loss; ``input``: rank 1's batch
holds a NaN row; ``shard``: rank 1's batch holds a zero row, which ``UnsafeNorm`` (between the
column- and the row-wise layer, on rank 1's slice of the hidden units) divides 0 by 0;
``update``: a row-wise embedding whose rows 5-9 (rank 1's shard) get zero gradients, which an
Adam without eps makes NaN; ``slice``: rank 1 zeroes its shard of ``w3``, so ``UnsafeNorm``
divides 0 by 0 on its slice alone (the unsharded model's norm is not 0); ``sp``: a sequence-parallel block whose embedding row 6 (rank 1's
first row) the loop writes NaN into before a batch that looks it up.
"""

import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from fsdp_update_train import NoEpsAdam
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel,
                                               parallelize_module)

import modes
from recorder import FlightRecorder, NonFiniteError

BAD_STEP, BAD_ROW, ZERO_ROW, BAD_TOKEN = 3, 2, 5, 6


class UnsafeNorm(nn.Module):
    def forward(self, h):
        return h / h.norm(dim=-1, keepdim=True)  # the bug: no eps


class FeedForward(nn.Module):  # torchtitan's, with a norm in the sharded region
    def __init__(self, d: int = 6, hidden: int = 16):
        super().__init__()
        self.w1 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)
        self.w3 = nn.Linear(d, hidden, bias=False)
        self.norm = UnsafeNorm()

    def forward(self, x):
        return self.w2(self.norm(F.silu(self.w1(x)) * self.w3(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.ff = FeedForward()
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.ff(x))


class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, tokens):
        return self.head(self.emb(tokens).mean(1))


class Attention(nn.Module):
    def __init__(self, d: int = 8, head_dim: int = 4):
        super().__init__()
        self.head_dim = head_dim
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))  # (-1: this rank's heads)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, vocab: int = 11, d: int = 8):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.norm = nn.LayerNorm(d)
        self.attn = Attention(d)
        self.out = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.tok(tokens)
        return self.out(x + self.attn(self.norm(x)))


def make_net() -> nn.Module:
    return Net()


def make_bag() -> nn.Module:
    return Bag()


def make_block() -> nn.Module:
    return Block()


def _parallel(mode: str) -> tuple[nn.Module, str]:
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    if mode == "update":
        model = make_bag()
        parallelize_module(model, mesh, {"emb": RowwiseParallel()})
        return model, "tp_train:make_bag"
    if mode == "sp":
        model = make_block()
        parallelize_module(model, mesh, {
            "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1),),
                                       desired_input_layouts=(Replicate(),)),
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(), "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
            "out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
        return model, "tp_train:make_block"
    model = make_net()
    parallelize_module(model.ff, mesh, {"w1": ColwiseParallel(), "w3": ColwiseParallel(),
                                        "w2": RowwiseParallel()})
    return model, "tp_train:make_net"


def _batch(mode: str, step: int, g: torch.Generator, rank: int, model: nn.Module):
    if mode == "update":  # tokens 0-4 only: rows 5-9 (rank 1's shard) get no gradient
        return torch.randint(0, 5, (8, 3), generator=g), torch.randint(0, 3, (8,), generator=g)
    if mode == "sp":
        t = torch.randint(0, 11, (4, 6), generator=g)
        if step == BAD_STEP and rank == 1:
            with torch.no_grad():  # rank 1's first local row is the full weight's row 6
                model.tok.weight.to_local()[0, 2] = float("nan")
        if step == BAD_STEP:
            t[1, 3] = BAD_TOKEN
        return t, t.roll(-1, 1)
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
    if mode == "input" and rank == 1 and step == BAD_STEP:
        x[BAD_ROW] = float("nan")
    if mode == "shard" and rank == 1 and step == BAD_STEP:
        x[ZERO_ROW] = 0.0  # (no biases: the hidden row is 0 on every rank's slice)
    if mode == "slice" and rank == 1 and step == BAD_STEP:
        with torch.no_grad():  # rank 1's slice of the hidden units is 0, rank 0's is not
            model.ff.w3.weight.to_local().zero_()
    return x, y


class TokenLoss(nn.Module):
    def forward(self, logits, y):
        return F.cross_entropy(logits.flatten(0, -2), y.flatten())


def _host_reads(mode: str):
    """``healthy``: tests/test_recorder_sync.py's counter of host reads, else nothing."""
    if mode != "healthy":
        return contextlib.nullcontext([])
    sys.path.insert(0, str(Path(__file__).parent.parent))
    from test_recorder_sync import count_host_reads

    return count_host_reads()


def run(out_dir: str, mode: str) -> None:
    rank = dist.get_rank()
    model, factory = _parallel(mode)
    opt = (NoEpsAdam if mode == "update" else torch.optim.AdamW)(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)  # the same batches on both ranks, as TP needs
    crit = TokenLoss()
    rec = contextlib.nullcontext() if mode == "bare" else FlightRecorder(
        model, opt, loss_fn=crit, out_dir=out_dir, factory=factory)
    try:
        with rec, _host_reads(mode) as reads:
            for step in range(6):
                x, y = _batch(mode, step, g, rank, model)
                opt.zero_grad()
                loss = crit(model(x), y)
                loss.backward()
                opt.step()
                # (the recorder's host reads so far: one per step after the first's set-up)
                ours = sum("/recorder/" in f for _, f in reads)
                print(f"rank {rank} step {step} loss {loss.item()!r} reads {ours}", flush=True)
        print(f"rank {rank} no event", flush=True)
    except NonFiniteError as e:
        ev = e.event
        print(f"rank {rank} event step={ev['step']} phase={ev['phase']} module={ev.get('module')}"
              f" samples={ev.get('samples')} params={ev.get('params')} "
              f"first={ev['ranks']['first']} bundle={e.bundle_path}", flush=True)


if __name__ == "__main__":
    modes.main(run, sys.argv[1], *sys.argv[2:])
