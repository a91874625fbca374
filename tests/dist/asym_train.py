"""Two ranks that do not do the same thing every step (torchrun, gloo, CPU), launched by
tests/test_dist_asymmetry.py; one launch runs the modes named on the command line in turn
(tests/dist/modes.py). A mode ``NAME-bare`` trains the same without the recorder.

``lr0``: rank 0 alone runs a learning-rate range test on the unwrapped model inside
``with rec.paused():`` (restoring the weights and optimizer after) while rank 1 waits at a
barrier. ``lrboth``: both ranks run the range test through the DDP model, paused.
``metric0``: after every update rank 0 alone computes a training accuracy from a model call
outside ``torch.no_grad()``. ``early``: rank 0 alone validates (no_grad) and decides early
stopping, broadcast to rank 1. ``join``: rank 1 has one batch fewer, under DDP's ``Join``
(entered inside the recorder's block). ``solo``: each rank trains a model of its own (no DDP,
different numbers of steps: its recorder detaches when its loop ends), then the ranks gather
their results. ``*-nan``: the mode, with a NaN feature in sample 2 of rank 1's batch at
training step 4.
"""

import copy
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join

import modes
from recorder import FlightRecorder, NonFiniteError

STEPS = 6


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _batches(rank: int, n: int):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g))
            for _ in range(n)]


def _range_test(model, opt, crit, batches) -> float:
    """torch-lr-finder's loop, by hand: raise the rate until the loss diverges, then restore."""
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    best, lr = float("inf"), 1e-3
    for x, y in batches * 4:
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad()
        loss = crit(model(x), y)
        loss.backward()
        opt.step()
        if not torch.isfinite(loss) or loss.item() > 4 * best:
            break
        best, lr = min(best, loss.item()), lr * 10
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    return lr


def _train(model, opt, crit, x, y) -> None:
    opt.zero_grad()
    crit(model(x), y).backward()
    opt.step()


def _ddp_loop(model, opt, crit, rank: int, mode: str, rec) -> int:
    """The DDP modes' loop; returns the steps trained."""
    kind = mode.removesuffix("-nan").removesuffix("-bare")
    batches = _batches(rank, STEPS)
    if kind.startswith("join") and rank == 1:
        batches = batches[:-1]
    val = _batches(10 + rank, 2)
    best, bad, done = float("inf"), 0, 0
    with Join([model]) if kind == "join" else _nothing():
        for step, (x, y) in enumerate(batches):
            if step == 2 and kind in ("lr0", "lrboth"):
                if kind == "lrboth" or rank == 0:
                    with rec.paused() if rec else _nothing():
                        _range_test(model.module if kind == "lr0" else model, opt, crit,
                                    _batches(50, 3))
                if kind == "lr0":
                    dist.barrier()
            if mode.endswith("-nan") and rank == 1 and step == 4:
                x = x.clone()
                x[2, 5] = float("nan")
            _train(model, opt, crit, x, y)
            done += 1
            if kind in ("metric0", "valgrad0") and rank == 0:
                if kind == "valgrad0":
                    model.eval()  # a validation without torch.no_grad()
                acc = (model(x).argmax(1) == y).float().mean()  # outside no_grad
                model.train()
                print(f"rank 0 step {step} acc {acc.item():.3f}", flush=True)
            if kind == "early":
                stop = torch.zeros(1)
                if rank == 0:
                    model.eval()
                    with torch.no_grad():
                        v = sum(crit(model.module(xv), yv).item() for xv, yv in val)
                    model.train()
                    bad = 0 if v < best else bad + 1
                    best = min(best, v)
                    stop[0] = float(step >= 4)  # (patience reached, here at step 4)
                dist.broadcast(stop, 0)
                if stop.item():
                    break
    return done


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _solo(out_dir: str, rank: int, mode: str) -> int:
    torch.manual_seed(rank)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.CrossEntropyLoss()
    batches = _batches(rank, STEPS if rank == 0 else STEPS - 2)
    done = 0
    rec = None if mode.endswith("-bare") else FlightRecorder(
        model, opt, loss_fn=crit, out_dir=out_dir, factory="asym_train:make_model")
    try:
        with rec or _nothing():
            for step, (x, y) in enumerate(batches):
                if (mode.endswith("-nan") and rank == 1 and step == 1) or \
                        (mode.endswith("-late") and rank == 0 and step == 5):
                    x = x.clone()
                    x[2, 5] = float("nan")
                _train(model, opt, crit, x, y)
                done += 1
    except NonFiniteError as e:  # (this rank's run ends; the results are gathered all the same)
        print(f"rank {rank} event step={e.event['step']} phase={e.event['phase']} "
              f"bundle={e.bundle_path}", flush=True)
    results = [None, None]
    dist.all_gather_object(results, (rank, done, _sum(model)))
    print(f"rank {rank} gathered {results}", flush=True)
    return done


def _sum(model) -> str:
    return f"{sum(p.double().sum().item() for p in model.parameters()):.12f}"


def run(out_dir: str, mode: str) -> None:
    rank = dist.get_rank()
    done = 0
    model = None
    try:
        if mode.startswith("solo"):
            done = _solo(out_dir, rank, mode)
            print(f"rank {rank} no event trained={done}", flush=True)
            return
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(make_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        crit = nn.CrossEntropyLoss()
        if mode.endswith("-bare"):
            done = _ddp_loop(model, opt, crit, rank, mode, None)
        else:
            with Join([model]) if mode.startswith("joininner") else _nothing(), \
                    FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                                factory="asym_train:make_model") as rec:
                done = _ddp_loop(model, opt, crit, rank, mode, rec)
            print(f"rank {rank} recorded steps={rec.step}", flush=True)
        print(f"rank {rank} no event trained={done} weights={_sum(model)}", flush=True)
    except NonFiniteError as e:
        ev = e.event
        print(f"rank {rank} event step={ev['step']} phase={ev['phase']} "
              f"first={ev.get('ranks', {}).get('first')} bundle={e.bundle_path}", flush=True)
        print(f"rank {rank} message {e}", flush=True)


if __name__ == "__main__":
    modes.main(run, *sys.argv[1:])
