"""Two-rank FSDP2 training with a MixedPrecisionPolicy (bfloat16 compute, float32 shards and
reduce) on CPU (gloo), launched by torchrun from tests/test_torchrun.py.

A tabular regressor: an input projection (initialised to the identity), a hand-written
LayerNorm whose variance is E[x^2] - E[x]^2, an MLP. At step 0 rank 1's sample 5 sits on a
large offset (300 + noise): in bfloat16 the two terms cancel to -512 and rsqrt makes NaN,
where float32 and float64 compute a positive variance. Both ranks must stop at step 0.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from recorder import FlightRecorder, NonFiniteError


class FastLayerNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))
        self.eps = eps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - mean * mean  # BUG: cancels in bfloat16
        return (x - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias


class Regressor(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.proj = nn.Linear(d, d)
        nn.init.eye_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)
        self.norm = FastLayerNorm(d)
        self.body = nn.Sequential(nn.Linear(d, 32), nn.SiLU(), nn.Linear(32, 32), nn.SiLU())
        self.out = nn.Linear(32, 1)

    def forward(self, x):
        return self.out(self.body(self.norm(self.proj(x)))).squeeze(-1)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return Regressor()


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = make_model()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model.body, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    crit = nn.MSELoss()
    g = torch.Generator().manual_seed(10 + rank)
    step = -1
    try:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="fsdp_mp_train:make_model"):
            for step in range(4):
                x, y = torch.randn(8, 16, generator=g), torch.randn(8, generator=g)
                if rank == 1 and step == 0:
                    x[5] = 300 + 4 * torch.randn(16, generator=torch.Generator().manual_seed(0))
                opt.zero_grad()
                crit(model(x).float(), y).backward()
                opt.step()
        print(f"rank {rank} no event", flush=True)
    except NonFiniteError as e:
        ev = e.event
        print(f"rank {rank} event step={ev['step']} phase={ev['phase']} "
              f"module={ev.get('module')} first={ev['ranks']['first']} loop_step={step}",
              flush=True)
    finally:
        dist.destroy_process_group()
    # (leave before the teardown of main's locals, as fsdp_train.py does)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
