"""Two-rank FSDP2 training on CPU (gloo), launched by torchrun from tests/test_torchrun.py.

The blocks and the root are each ``fully_shard``-ed (nested), so every parameter is a DTensor
holding half the rows on each rank. At step 3 rank 1's batch holds a blank record (sample 5 all
zeros): ``UnsafeNorm`` divides 0 by 0 there. Only rank 1 makes the NaN; the reduce-scatter
hands rank 0 NaN gradient shards. Both ranks must stop at step 3 in raise mode, each write its
own bundle, and none may hang.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from recorder import FlightRecorder, NonFiniteError


class UnsafeNorm(nn.Module):
    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        std = x.std(-1, keepdim=True)
        return (x - mean) / std  # the bug: no eps, 0/0 for a constant row


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.GELU()

    def forward(self, x):
        return x + self.act(self.fc(x))


class Net(nn.Module):
    def __init__(self, width: int = 12, depth: int = 2, classes: int = 5):
        super().__init__()
        self.norm = UnsafeNorm()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = self.norm(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def make_model() -> nn.Module:
    return Net()


def main(out_dir: str, steps: int = 10, bad_step: int = 3) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = make_model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    crit = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(rank)
    step = -1
    try:
        rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                             factory="fsdp_train:make_model")
        before = torch.get_rng_state()
        rec.attach()  # agrees on the run id with the other rank: torch's RNG is not drawn
        print(f"rank {rank} rng_unchanged={torch.equal(before, torch.get_rng_state())}",
              flush=True)
        with rec:
            for step in range(steps):
                x = torch.randn(8, 12, generator=g)
                y = torch.randint(0, 5, (8,), generator=g)
                if rank == 1 and step == bad_step:
                    x[5] = 0.0
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
        print(f"rank {rank} no event", flush=True)
    except NonFiniteError as e:
        ev = e.event
        print(f"rank {rank} event step={ev['step']} phase={ev['phase']} "
              f"module={ev.get('module')} first={ev['ranks']['first']} loop_step={step} "
              f"bundle={e.bundle_path}", flush=True)
        print(f"rank {rank} message {e}", flush=True)
    finally:
        dist.destroy_process_group()
    # Leave before main's locals (the model, the process group) are torn down: that teardown
    # hung a rank now and then under a loaded machine, after the run was done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
