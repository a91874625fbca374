"""The options real DDP and FSDP2 scripts turn on, two CPU ranks (torchrun, gloo), launched by
tests/test_torchrun.py. Mode ``KIND-OPTION-WHAT``:

KIND-OPTION: ``ddp-bucketview`` (``gradient_as_bucket_view=True``: the gradients are views into
DDP's buckets), ``ddp-nobcast`` (``broadcast_buffers=False``), ``ddp-static``
(``static_graph=True``), ``ddp-unused`` (``find_unused_parameters=True``, the ``aux`` branch
skipped at odd steps), ``fsdp-noreshard`` (``reshard_after_forward=False``), ``fsdp-accum``
(2 micro-batches, ``set_requires_gradient_sync(False)`` for the first), ``fsdp-mp``
(``MixedPrecisionPolicy`` bf16 parameters, fp32 reduction), ``fsdp-dcp`` (3 steps, a
``torch.distributed.checkpoint`` save of the sharded model and optimizer, a fresh model and
optimizer loaded from it, a new recorder with ``start_step`` for the next 3). FSDP2's
``CPUOffloadPolicy`` needs an accelerator (fully_shard refuses it on CPU).

WHAT: ``bare`` (no recorder), ``rec`` (recorded, healthy), ``nan`` (rank 1's micro-batch 0 row
``BAD_ROW`` blank at step ``BAD_STEP``, ``BAD_STEP + 1`` under dcp: the resumed part; 0/0 in
``UnsafeNorm``), ``rw`` (that with ``rewind=2``). A healthy mode prints its losses and weights
in hex.
"""

import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

import modes
from recorder import FlightRecorder, NonFiniteError

BAD_STEP, BAD_ROW, STEPS = 3, 5, 6
CRIT = nn.CrossEntropyLoss()


class UnsafeNorm(nn.Module):
    def forward(self, x):
        return (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True)  # 0/0 for a blank row


class Net(nn.Module):
    def __init__(self, bn: bool = True):
        super().__init__()
        self.norm = UnsafeNorm()
        self.fc = nn.Linear(12, 12)
        self.bn = nn.BatchNorm1d(12) if bn else nn.Identity()  # (bf16 FSDP: no BatchNorm)
        self.aux = nn.Linear(12, 12)
        self.head = nn.Linear(12, 5)
        self.use_aux = True

    def forward(self, x):
        h = self.bn(torch.relu(self.fc(self.norm(x))))
        if self.use_aux:
            h = h + self.aux(h)
        return self.head(h)


def make_model() -> nn.Module:
    return Net()


def make_plain() -> nn.Module:
    return Net(bn=False)


def wrap(kind: str, option: str, model: nn.Module) -> nn.Module:
    if kind == "ddp":
        kw = {"bucketview": {"gradient_as_bucket_view": True},
              "nobcast": {"broadcast_buffers": False}, "static": {"static_graph": True},
              "unused": {"find_unused_parameters": True}}[option]
        return nn.parallel.DistributedDataParallel(model, **kw)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    kw = {"mp": {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)},
          "noreshard": {"reshard_after_forward": False}}.get(option, {})
    fully_shard(model.fc, **kw)
    fully_shard(model, **kw)
    return model


def train(model, opt, g, steps, bad, option, losses, start=0):
    inner, crit = getattr(model, "module", model), CRIT
    accum = 2 if option == "accum" else 1
    for step in range(start, start + steps):
        opt.zero_grad()
        for mb in range(accum):
            x = torch.randn(8, 12, generator=g)
            y = torch.randint(0, 5, (8,), generator=g)
            if step == bad and mb == 0 and dist.get_rank() == 1:
                x[BAD_ROW] = 0.0
            inner.use_aux = option != "unused" or step % 2 == 0
            if accum > 1:  # FSDP2's no_sync: reduce-scatter at the last micro-batch only
                model.set_requires_gradient_sync(mb == accum - 1)
            loss = crit(model(x), y) / accum
            loss.backward()
            losses.append(loss.item())
        opt.step()


def run(out_dir: str, mode: str) -> None:
    kind, option, what = mode.split("-")
    rank = dist.get_rank()
    torch.manual_seed(0)
    make = make_model if kind == "ddp" else make_plain
    model = wrap(kind, option, make())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    losses = []
    kw = {"out_dir": out_dir, "loss_fn": CRIT, "factory": f"options_train:{make.__name__}",
          **({"rewind": 2} if what == "rw" else {})}
    bad = BAD_STEP if what in ("nan", "rw") else None
    try:
        if option == "dcp":
            model = resumed(model, opt, g, losses, out_dir, kw if what != "bare" else None, bad)
        else:
            with FlightRecorder(model, opt, **kw) if what != "bare" else nullcontext():
                train(model, opt, g, STEPS, bad, option, losses)
        with torch.no_grad():
            w = sum(float(getattr(p, "full_tensor", p.detach)().double().sum())
                    for p in model.parameters())
        print(f"rank {rank} no event losses={[x.hex() for x in losses]} w={w.hex()}", flush=True)
    except NonFiniteError as e:
        ev = e.event
        print(f"rank {rank} event step={ev['step']} phase={ev['phase']} module={ev.get('module')} "
              f"first={ev['ranks']['first']} bundle={e.bundle_path}", flush=True)


def resumed(model, opt, g, losses, out_dir, kw, bad):
    """Half the steps, a DCP checkpoint (beside ``out_dir``), a fresh model and optimizer
    loaded from it, the rest (``kw``: the recorders' arguments, None for no recorder); the
    model trained last."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    half, ckpt = STEPS // 2, out_dir + "-ckpt"
    with FlightRecorder(model, opt, **kw) if kw else nullcontext():
        train(model, opt, g, half, None, "dcp", losses)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    torch.manual_seed(1)  # (other initial weights: the load must replace them all)
    model = wrap("fsdp", "dcp", make_plain())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    with FlightRecorder(model, opt, start_step=half, **kw) if kw else nullcontext():
        train(model, opt, g, STEPS - half, None if bad is None else half + 1, "dcp", losses,
              start=half)
    return model


if __name__ == "__main__":
    modes.main(run, *sys.argv[1:])
