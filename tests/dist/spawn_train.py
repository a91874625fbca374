"""DDP training launched the way PyTorch's DDP tutorial does: ``mp.spawn`` (no torchrun, so no
RANK/WORLD_SIZE variables), gloo, a DistributedSampler with ``set_epoch``, and
``destroy_process_group`` at the end; run by tests/test_spawn.py.

Each rank trains twice from the same seed, without and with the recorder (its losses saved
for comparison), then once more with the recorder on data whose row BAD_ROW holds a NaN: the
rank the sampler gives that row raises NonFiniteError, which ``mp.spawn`` re-raises.
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


def train(rank, world_size, port, out_dir, bad_row):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    plain = _train(rank, world_size, out_dir, False)
    recorded = _train(rank, world_size, out_dir, True)
    with open(os.path.join(out_dir, f"losses-rank{rank}.txt"), "w") as f:
        f.write(f"{plain!r}\n{recorded!r}\n")
    os.makedirs(os.path.join(out_dir, "bad"), exist_ok=True)
    try:
        _train(rank, world_size, os.path.join(out_dir, "bad"), True, bad_row)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    out, port, bad = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    mp.spawn(train, args=(2, port, out, bad), nprocs=2, join=True)
