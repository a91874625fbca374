"""Two-rank DDP CLIP-style training on CPU (gloo), launched by torchrun from
tests/test_torchrun.py.

The contrastive loss gathers every rank's features (``dist.all_gather``, the current rank's own
slot kept with its gradient, as open_clip's ClipLoss does) to use them as negatives. At step 3
both ranks resume from a checkpoint whose ``logit_scale`` was saved exponentiated (88.5, so
the forward's ``exp`` gives 2.7e38): the loss's logits overflow float32 on every rank.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from recorder import FlightRecorder, NonFiniteError


class TwoTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.image = nn.Sequential(nn.Linear(24, 32), nn.GELU(), nn.Linear(32, 16))
        self.text = nn.Linear(12, 16)
        self.logit_scale = nn.Parameter(torch.tensor(2.659))

    def forward(self, image, text):
        return (F.normalize(self.image(image), dim=-1), F.normalize(self.text(text), dim=-1),
                self.logit_scale.exp())


def make_model() -> nn.Module:
    return TwoTower()


class ClipLoss(nn.Module):
    def __init__(self, rank: int = 0, world_size: int = 1):
        super().__init__()
        self.rank, self.world_size = rank, world_size

    def gather(self, x):
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.detach())  # LINE gather
        parts[self.rank] = x
        return torch.cat(parts)

    def forward(self, image, text, scale):
        all_image, all_text = self.gather(image), self.gather(text)
        labels = torch.arange(image.shape[0]) + self.rank * image.shape[0]
        return (F.cross_entropy(scale * image @ all_text.t(), labels)
                + F.cross_entropy(scale * text @ all_image.t(), labels)) / 2


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(make_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    crit = ClipLoss(rank, dist.get_world_size())
    g = torch.Generator().manual_seed(rank)
    step = -1
    try:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="ddp_clip_train:make_model"):
            for step in range(6):
                image, text = torch.randn(8, 24, generator=g), torch.randn(8, 12, generator=g)
                if step == 3:
                    with torch.no_grad():
                        model.module.logit_scale.fill_(88.5)
                opt.zero_grad()
                crit(*model(image, text)).backward()
                opt.step()
        print(f"rank {rank} no event", flush=True)
    except NonFiniteError as e:
        ev = e.event
        print(f"rank {rank} event step={ev['step']} phase={ev['phase']} loop_step={step}",
              flush=True)
    finally:
        dist.destroy_process_group()
    # (leave before the teardown of main's locals, as ddp_train.py does)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
