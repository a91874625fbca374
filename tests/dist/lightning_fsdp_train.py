"""Lightning's ``ModelParallelStrategy`` (FSDP2 ``fully_shard`` in ``configure_model``) on two
CPU ranks (torchrun, gloo) with the recorder's callback, launched from tests/test_torchrun.py.

The same planted bug as fsdp_train.py: rank 1's batch of step 3 holds a blank record, which
``UnsafeNorm`` turns into 0/0. Both ranks must raise at step 3, each with its bundle.
"""

import sys

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard

from fsdp_train import make_model
from recorder import NonFiniteError
from recorder.lightning import FlightRecorderCallback


class Batches(torch.utils.data.IterableDataset):
    def __iter__(self):
        rank = torch.distributed.get_rank()
        g = torch.Generator().manual_seed(rank)
        for step in range(10):
            x = torch.randn(8, 12, generator=g)
            y = torch.randint(0, 5, (8,), generator=g)
            if rank == 1 and step == 3:
                x[5] = 0.0
            yield x, y


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = make_model()
        self.criterion = nn.CrossEntropyLoss()

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch, i):
        x, y = batch
        return self.criterion(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=1e-2)


def main(out_dir: str) -> None:
    torch.manual_seed(0)
    cb = FlightRecorderCallback(module="model", loss_fn="criterion", out_dir=out_dir,
                                factory="fsdp_train:make_model")
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                     process_group_backend="gloo")
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=10,
                        callbacks=[cb], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    loader = torch.utils.data.DataLoader(Batches(), batch_size=None)
    rank = -1
    try:
        trainer.fit(Module(), loader)
        print(f"rank {trainer.global_rank} no event", flush=True)
    except NonFiniteError as e:
        rank = trainer.global_rank
        ev = e.event
        print(f"rank {rank} event step={ev['step']} phase={ev['phase']} "
              f"module={ev.get('module')} first={ev['ranks']['first']} "
              f"global_step={trainer.global_step} bundle={e.bundle_path}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
