"""Two-rank DDP training on CPU (gloo), launched by torchrun from tests/test_torchrun.py.

Mode ``input``: rank 1 gets a NaN feature in sample 2 at step 3. DDP averages
gradients, so both ranks see the bad step: each must write its own bundle and stop at that step,
none may hang. Mode ``loss``: at step 3 every target of rank 1 is ``ignore_index``, so its mean
loss is 0/0 while every gradient stays finite: only rank 1 sees a NaN, and rank 0 must still stop
at the same step (else it would wait in step 4's all-reduce for a rank that raised). Mode
``eval``: before step 3 each rank runs an evaluation forward (eval mode, no gradients) whose
batch holds a NaN on rank 1 only, with ``on_event="warn"``: rank 1 writes its bundle there, and
both ranks train on. Mode ``eval0``: before step 3 rank 0 alone runs evaluation forwards (eval
mode, and one in train mode under no_grad), as a validation on rank 0 does: no rank may hang.
Mode ``warn``: mode ``input``'s NaN with ``on_event="warn"``: both ranks warn and train on.
Mode ``rewind``: mode ``input``'s NaN with ``rewind=2``. One launch runs the modes named on the
command line in turn (tests/dist/modes.py).
"""

import sys

import torch
import torch.distributed as dist
from torch import nn

import modes
from recorder import FlightRecorder, NonFiniteError


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _broken():
    raise RuntimeError("a bug in the recorder")


def run(out_dir: str, mode: str) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(rank)
    step = -1
    try:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="ddp_train:make_model",
                            on_event="warn" if mode in ("warn", "eval") else "raise",
                            rewind=2 if mode == "rewind" else None) as rec:
            for step in range(10):
                if rank == 1 and step == 3 and mode == "internal":
                    rec.cycle.capture_rng = _broken  # a recorder bug, on one rank only
                x = torch.randn(6, 8, generator=g)
                y = torch.randint(0, 4, (6,), generator=g)
                if rank == 1 and step == 3 and mode in ("input", "warn", "rewind"):
                    x[2, 5] = float("nan")
                if rank == 1 and step == 3 and mode == "loss":
                    y[:] = -100  # CrossEntropyLoss's ignore_index
                if step == 3 and mode == "eval":
                    model.eval()
                    with torch.no_grad():
                        xe = x.clone()
                        if rank == 1:
                            xe[1, 2] = float("nan")
                        model(xe)
                    model.train()
                if step == 3 and mode == "eval0" and rank == 0:
                    with torch.no_grad():
                        model.module(x)  # a train-mode validation of the unwrapped model
                        model.eval()
                        model(x)
                    model.train()
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
        print(f"rank {rank} no event steps={rec.step} active={rec.health.active} "
              f"errors={rec.health.internal_errors}", flush=True)
    except NonFiniteError as e:
        ev = e.event
        print(f"rank {rank} event step={ev['step']} phase={ev['phase']} "
              f"tensor={ev.get('tensor')} samples={ev.get('samples')} bundle={e.bundle_path}",
              flush=True)
        print(f"rank {rank} first={ev['ranks']['first']} loop_step={step} message {e}",
              flush=True)
        print(f"rank {rank} evaluation={ev.get('evaluation')}", flush=True)


if __name__ == "__main__":
    modes.main(run, *sys.argv[1:])
