"""ZeRO-1 on two CPU ranks (torchrun, gloo): DDP with ``ZeroRedundancyOptimizer`` sharding
Adam's state (``parameters_as_bucket_view=True``, ``overlap_with_ddp=False``), launched once by
tests/test_zero_optimizer.py with every mode (tests/dist/modes.py).

Modes: ``healthy`` (no event; each rank prints its parameters' checksum), ``bare`` (the same
without the recorder), ``eps0`` (Adam with
``eps=0``: the embedding rows no token looks up get a 0 gradient, so the first update divides
0 by sqrt(0) there; only the rank that owns the embedding computes it, then broadcasts it),
``eps0guard`` (the same, ``guard_optimizer=True``: the update is checked as it returns),
``sample`` (rank 1's sample 2 holds a NaN feature at step 2), ``loss`` (rank 1's batch at
step 2 is weighted 0 throughout: the weighted mean is 0/0 on rank 1 only), ``scale`` (rank 0's
sample 1 at step 1 holds features of 3e38: ``proj`` overflows), ``empty`` (rank
0's sample 3 at step 1 is all padding: its pooled embedding is 0, whose norm's sqrt is finite
and whose gradient is not: a backward-only NaN), ``rewind`` (``rewind=2``; rank 1's sample 2
holds a NaN at step 5: the window re-runs steps 2-5 from a copy of every rank's state shard). Models and data:
tests/zero_optimizer_models.py.
"""

import contextlib
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

import modes
import zero_optimizer_models as M
from recorder import FlightRecorder, NonFiniteError


def run(out_dir: str, mode: str) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(M.make_model())
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                  parameters_as_bucket_view=True, overlap_with_ddp=False,
                                  lr=1e-2, eps=0.0 if mode.startswith("eps0") else 1e-8)
    held = {id(p) for p in opt.optim.param_groups[0]["params"]}
    print(f"rank {rank} holds {[n for n, p in model.module.named_parameters() if id(p) in held]}",
          flush=True)
    crit = M.WeightedCE()
    records = M.Records(24, seed=rank)
    if rank == 1 and mode == "sample":
        records.feats[2 * 4 + 2, 1] = float("nan")  # step 2, sample 2
    if rank == 1 and mode == "rewind":
        records.feats[5 * 4 + 2, 1] = float("nan")  # step 5, sample 2, after sharded state
    if rank == 0 and mode == "scale":
        records.feats[1 * 4 + 1] = 3e38  # step 1, sample 1: a record in the wrong units
    if rank == 0 and mode == "empty":
        records.mask[1 * 4 + 3] = 0.0  # step 1, sample 3: a record with no token left
    if rank == 1 and mode == "loss":
        records.weights[2 * 4:3 * 4] = 0.0  # step 2's batch, all weighted 0
    step = -1
    try:
        with contextlib.nullcontext() if mode == "bare" else FlightRecorder(
                model, opt, loss_fn=crit, out_dir=out_dir,
                factory="zero_optimizer_models:make_model", guard_optimizer=mode == "eps0guard",
                rewind=2 if mode == "rewind" else None):
            for step, (tokens, mask, feats, y, w) in enumerate(M.loader(records)):
                opt.zero_grad()
                loss = crit(model(tokens, mask, feats), y, w)
                loss.backward()
                opt.step()
        total = sum(float(p.double().sum()) for p in model.parameters())
        print(f"rank {rank} no event steps={step + 1} checksum={total!r}", flush=True)
    except NonFiniteError as e:
        ev = e.event
        print(f"rank {rank} event step={ev['step']} phase={ev['phase']} "
              f"tensor={ev.get('tensor')} samples={ev.get('samples')} params={ev.get('params')} "
              f"first={ev['ranks']['first']} loop_step={step} bundle={e.bundle_path}",
              flush=True)


if __name__ == "__main__":
    modes.main(run, *sys.argv[1:])
