"""DDP training launched the way PyTorch's DDP tutorial does: ``mp.spawn`` (no torchrun, so no
RANK/WORLD_SIZE variables), gloo, a DistributedSampler with ``set_epoch``, and
``destroy_process_group`` at the end; run by tests/test_spawn.py.

Each rank trains twice from the same seed, without and with the recorder (its losses saved
for comparison), then once more with the recorder on data whose row BAD_ROW holds a NaN: the
rank the sampler gives that row raises NonFiniteError, which ``mp.spawn`` re-raises; that
rank writes its bundle slowly (``_slow_first_write``), so the other rank's is written first.
"""

import contextlib
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from recorder import FlightRecorder

BATCH = 4
EPOCHS = 2


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(8, 16)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def make_data(bad_row=None) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 8, generator=g)
    y = torch.randint(0, 4, (16,), generator=g)
    if bad_row is not None:
        x[bad_row, 3] = float("nan")
    return TensorDataset(x, y)


def _train(rank, world_size, out_dir, record, bad_row=None) -> list[float]:
    torch.manual_seed(0)
    model = DDP(ToyModel())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.CrossEntropyLoss()
    ds = make_data(bad_row)
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=BATCH, sampler=sampler)
    losses = []
    recorder = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir) if record else None
    with recorder or contextlib.nullcontext():
        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)
            for x, y in loader:
                opt.zero_grad()
                loss = crit(model(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
    return losses


def _slow_first_write(seconds: float = 3.0) -> None:
    """The rank that saw the event first writes its bundle slowly, as a large model's takes
    seconds: the other rank's bundle is written first, and its raise makes ``mp.spawn`` end
    the first rank, unless the ranks wait for each other's bundles before raising."""
    import time

    from recorder import bundle

    write = bundle.write_bundle

    def slow(out_dir, stem, meta, tensors):
        ranks = meta["event"].get("ranks") or {}
        if ranks.get("rank") in ranks.get("first", []):
            time.sleep(seconds)
        return write(out_dir, stem, meta, tensors)

    bundle.write_bundle = slow


def train(rank, world_size, port, out_dir, bad_row):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    plain = _train(rank, world_size, out_dir, False)
    recorded = _train(rank, world_size, out_dir, True)
    with open(os.path.join(out_dir, f"losses-rank{rank}.txt"), "w") as f:
        f.write(f"{plain!r}\n{recorded!r}\n")
    os.makedirs(os.path.join(out_dir, "bad"), exist_ok=True)
    _slow_first_write()
    # as the tutorial's demo functions end: cleanup() after training, not in a finally (an
    # error leaves the process group to the process's exit)
    _train(rank, world_size, os.path.join(out_dir, "bad"), True, bad_row)
    dist.destroy_process_group()


if __name__ == "__main__":
    out, port, bad = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    mp.spawn(train, args=(2, port, out, bad), nprocs=2, join=True)
