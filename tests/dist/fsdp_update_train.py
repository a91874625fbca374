"""FSDP2 on two CPU ranks (torchrun, gloo) with a hand-written Adam that has no epsilon,
launched from tests/test_torchrun.py.

Tokens come from rows 0-4 of a 10-row embedding only, so rows 5-9 (rank 1's shard) get zero
gradients: the update divides 0 by sqrt(0) there and writes NaN into rank 1's shard only, at
step 0. Mode ``default``: the update's evidence is read with step 1's check; mode ``guard``
(``guard_optimizer=True``): right after the update; mode ``exit``: the loop has one step, so
the ``with`` block's exit reads it. Either way both ranks must stop together.
"""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import modes
from recorder import FlightRecorder, NonFiniteError


class NoEpsAdam(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999)):
        super().__init__(params, {"lr": lr, "betas": betas})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["m"], state["v"] = torch.zeros_like(p), torch.zeros_like(p)
                state["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                state["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                p.sub_(group["lr"] * state["m"] / state["v"].sqrt())  # the bug: no eps


class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, tokens):
        return self.head(self.emb(tokens).mean(1))


def make_model() -> nn.Module:
    return Bag()


def run(out_dir: str, mode: str) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = make_model()
    fully_shard(model.emb)
    fully_shard(model)
    opt = NoEpsAdam(model.parameters())
    crit = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(rank)
    step = -1
    try:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="fsdp_update_train:make_model",
                            guard_optimizer=mode == "guard"):
            for step in range(1 if mode == "exit" else 6):
                tokens = torch.randint(0, 5, (8, 3), generator=g)
                y = torch.randint(0, 3, (8,), generator=g)
                opt.zero_grad()
                crit(model(tokens), y).backward()
                opt.step()
        print(f"rank {rank} no event", flush=True)
    except NonFiniteError as e:
        ev = e.event
        print(f"rank {rank} event step={ev['step']} phase={ev['phase']} params={ev['params']} "
              f"after_update={ev.get('after_update')} first={ev['ranks']['first']} "
              f"loop_step={step}", flush=True)


if __name__ == "__main__":
    modes.main(run, *sys.argv[1:])
