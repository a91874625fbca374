"""Two-rank DDP metric learning on CPU (gloo), launched by torchrun from tests/test_torchrun.py.

A triplet loss whose distances are written by hand, ``sqrt(((a - p) ** 2).sum(1))``. At step 3
rank 1's positive 2 is a copy of its anchor: the forward is finite, but sqrt's derivative at 0
makes NaN in backward, in rank 1's loss. DDP's all-reduce then hands rank 0 the same NaN
gradients, so both ranks see a backward event at step 3; only rank 1's loss made it.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from recorder import FlightRecorder, NonFiniteError


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 8))


class TripletLoss(nn.Module):
    def __init__(self, margin: float = 1.0):
        super().__init__()
        self.margin = margin

    def forward(self, a, p, n):
        d_ap = torch.sqrt(((a - p) ** 2).sum(1))  # BUG: sqrt'(0) when a == p
        d_an = torch.sqrt(((a - n) ** 2).sum(1))
        return torch.relu(d_ap - d_an + self.margin).mean()


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(make_model())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = TripletLoss()
    g = torch.Generator().manual_seed(rank)
    step = -1
    try:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="ddp_triplet_train:make_model"):
            for step in range(8):
                xa, xp, xn = torch.randn(3, 6, 10, generator=g)
                if rank == 1 and step == 3:
                    xp[2] = xa[2]  # a duplicate pair in rank 1's shard
                opt.zero_grad()
                a, p, n = model(torch.cat([xa, xp, xn])).chunk(3)
                crit(a, p, n).backward()
                opt.step()
        print(f"rank {rank} no event", flush=True)
    except NonFiniteError as e:
        ev = e.event
        print(f"rank {rank} event step={ev['step']} phase={ev['phase']} "
              f"first={ev['ranks']['first']} loop_step={step}", flush=True)
    finally:
        dist.destroy_process_group()
    # (leave before the teardown of main's locals, as ddp_train.py does)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
