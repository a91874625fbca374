"""Two-rank DDP training on CPU (gloo) with a communication hook registered, as users cut the
all-reduce's bandwidth, launched by torchrun from tests/test_torchrun.py.

Modes ``<hook>`` and ``<hook>-bare`` (hook: ``fp16``, ``powersgd``, ``allreduce``;
torch refuses ``bf16_compress_hook`` without CUDA and NCCL):
a healthy run with and without the recorder. Every mode weighs each record's loss (importance
weights, 1 by default). Mode ``overflow``: ``fp16_compress_hook``; at step 2 rank 1's record 3
weighs 1e6, so its local gradient is finite in float32 but over float16's 65504: the hook's
cast to float16 makes it inf, on both ranks after the all-reduce. Mode ``own``: the same
weight, under a float16 all-reduce hook the script writes itself (``half_allreduce``). Mode ``nan``:
``fp16_compress_hook``; at step 3 rank 1's sample 1 is a zero row that the model's hand-made
normalisation (eps outside the sqrt) turns into a NaN gradient in its local backward.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD

import modes
from recorder import FlightRecorder, NonFiniteError

HEAVY = 1e6  # record 3's importance weight on rank 1 at step 2 (mode overflow)


class Tagger(nn.Module):
    def __init__(self, d_in: int = 8, d: int = 16, classes: int = 4):
        super().__init__()
        self.proj = nn.Linear(d_in, d, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d, d), nn.ReLU())
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        h = self.proj(x)
        h = h / (h.pow(2).sum(-1, keepdim=True).sqrt() + 1e-6)  # BUG: sqrt'(0) at a 0 row
        return self.head(self.mlp(h))


def weighted_ce(logits, y, w):
    return (F.cross_entropy(logits, y, reduction="none") * w).mean()


def half_allreduce(process_group, bucket):
    """The gradients all-reduced in float16 (half the bytes), averaged after the sum."""
    world = dist.get_world_size()
    half = bucket.buffer().to(torch.float16)
    fut = dist.all_reduce(half, async_op=True).get_future()
    return fut.then(lambda f: bucket.buffer().copy_(f.value()[0]).div_(world))  # HOOK


def make_model() -> nn.Module:
    return Tagger()


def _register(model: nn.parallel.DistributedDataParallel, hook: str) -> None:
    if hook == "powersgd":
        state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                       start_powerSGD_iter=2, min_compression_rate=0.5)
        model.register_comm_hook(state, powerSGD.powerSGD_hook)
    elif hook == "own":
        model.register_comm_hook(None, half_allreduce)
    elif hook == "allreduce":
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    else:
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)


def _train(model, opt, crit, mode: str, rank: int, reads=()) -> tuple[list[float], list[int]]:
    """Each step's loss, and the recorder's host reads so far after each step."""
    g = torch.Generator().manual_seed(rank)
    losses, ours = [], []
    for step in range(6):
        x = torch.randn(4, 8, generator=g)
        y = torch.randint(0, 4, (4,), generator=g)
        w = torch.ones(4)
        if mode in ("overflow", "own") and rank == 1 and step == 2:
            w[3] = HEAVY  # a rare record, up-weighted
        if mode == "nan" and rank == 1 and step == 3:
            x[1] = 0.0  # an empty record
        opt.zero_grad()
        loss = crit(model(x), y, w)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        ours.append(sum("/recorder/" in f for _, f in reads))
    return losses, ours


def run(out_dir: str, mode: str) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(make_model())
    _register(model, mode.removesuffix("-bare"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = weighted_ce
    if mode.endswith("-bare"):
        print(f"rank {rank} done losses={_train(model, opt, crit, mode, rank)[0]}", flush=True)
        return
    sys.path.insert(0, str(Path(__file__).parent.parent))
    from test_recorder_sync import count_host_reads

    try:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="ddp_commhook_train:make_model") as rec, \
                count_host_reads() as reads:
            losses, ours = _train(model, opt, rec.loss_fn, mode, rank, reads)
        print(f"rank {rank} done losses={losses}", flush=True)
        print(f"rank {rank} reads={ours}", flush=True)
    except NonFiniteError as e:
        ev = e.event
        print(f"rank {rank} event step={ev['step']} phase={ev['phase']} "
              f"first={ev['ranks']['first']} tensor={ev.get('tensor')}", flush=True)


if __name__ == "__main__":
    modes.main(run, *sys.argv[1:])
