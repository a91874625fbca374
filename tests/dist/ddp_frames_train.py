"""Two-rank DDP audio-clip classifier on CPU (gloo), launched by torchrun from
tests/test_torchrun.py.

Frames are projected without bias and L2-normalised by hand with the eps outside the sqrt:
a zero (padding) frame gives a finite forward and a NaN gradient (sqrt'(0) times 0), inside
the model. At step 3 rank 1's clip 2 is 6 frames zero-padded to 10. DDP's all-reduce hands
rank 0 the same NaN gradient; neither rank's loss or output gradient is non-finite, so both
ranks saw the backward event at once. Mode ``clip``: the loop clips with
``error_if_nonfinite=True``, so every rank raises in the clip at step 3 (each checks the
cut-short step alone).
"""

import sys

import torch
import torch.distributed as dist
from torch import nn

import modes
from recorder import FlightRecorder, NonFiniteError


class FrameEncoder(nn.Module):
    def __init__(self, n_mels: int = 20, d: int = 32, classes: int = 5):
        super().__init__()
        self.proj = nn.Linear(n_mels, d, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d, d), nn.GELU())
        self.head = nn.Linear(d, classes)

    def forward(self, mel):
        h = self.proj(mel)
        h = h / (h.pow(2).sum(-1, keepdim=True).sqrt() + 1e-6)  # BUG: sqrt'(0) for a 0 frame
        return self.head(self.mlp(h).mean(1))


def make_model() -> nn.Module:
    return FrameEncoder()


def run(out_dir: str, mode: str) -> None:
    clip = mode == "clip"
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(make_model())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(rank)
    step = -1
    try:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="ddp_frames_train:make_model"):
            for step in range(6):
                mel = torch.randn(4, 10, 20, generator=g)
                y = torch.randint(0, 5, (4,), generator=g)
                if rank == 1 and step == 3:
                    mel[2, 6:] = 0.0  # a short clip, zero-padded
                opt.zero_grad()
                crit(model(mel), y).backward()
                if clip:  # the loop's own guard: every rank raises here
                    nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
                opt.step()
        print(f"rank {rank} no event", flush=True)
    except NonFiniteError as e:
        ev = e.event
        print(f"rank {rank} event step={ev['step']} phase={ev['phase']} "
              f"first={ev['ranks']['first']} loop_step={step}", flush=True)
    except RuntimeError as e:  # (clip's error; the recorder wrote the bundle on the way out)
        print(f"rank {rank} clip error at loop step {step}: {str(e)[:60]}", flush=True)


if __name__ == "__main__":
    modes.main(run, *sys.argv[1:])
