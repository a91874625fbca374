"""Pipeline parallelism on two CPU ranks (torchrun, gloo), as PyTorch's pipelining tutorial
writes it: an ``nn.Sequential`` split by hand into two stages, each rank holding one as a
``PipelineStage``, ``ScheduleGPipe`` or ``Schedule1F1B`` over 2 micro-batches, the loss on the
last stage only.

Modes ``<schedule>-<plant>[-w]``. The recorder is attached before the first step, whose
shape inference forwards uninitialised ``torch.empty`` buffers through each stage (and the last
stage's loss): no step, paused through (recorder.pipeline_stage); ``-w`` runs that first step
bare and attaches after it (``start_step=1``).
Plant ``bare`` (no recorder) and ``healthy`` print each step's losses on the last rank;
``last``: one unit of stage 1's first linear layer gets a bias of -50 at step BAD_STEP, so
``LogAct`` takes the log of negative numbers on every row; ``first``: row BAD_ROW of step
BAD_STEP's batch is zero, which stage 0's ``UnsafeNorm`` divides 0 by 0, and the NaN travels
to stage 1 and the loss.
"""

import contextlib
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import modes
from recorder import FlightRecorder, NonFiniteError

BAD_STEP, BAD_ROW, MICRO, BATCH = 3, 5, 2, 8


class UnsafeNorm(nn.Module):
    def forward(self, h):
        return h / h.norm(dim=-1, keepdim=True)  # the bug: no eps


class LogAct(nn.Module):
    def forward(self, h):
        return torch.log(h + 1.0)  # the bug: h < -1 is not excluded


def make_stage0() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8, bias=False), UnsafeNorm())


def make_stage1() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 8), LogAct(), nn.Linear(8, 3))


def _batch(step: int, g: torch.Generator, plant: str):
    x, y = torch.randn(BATCH, 4, generator=g), torch.randint(0, 3, (BATCH,), generator=g)
    if step == BAD_STEP and plant == "first":
        x[BAD_ROW] = 0.0
    return x, y


def _one_step(rank, schedule, opt, x, y, step):
    opt.zero_grad()
    if rank == 0:
        schedule.step(x)
    else:
        losses = []
        schedule.step(target=y, losses=losses)
        print(f"rank 1 step {step} losses {[repr(v.item()) for v in losses]}", flush=True)
    opt.step()


def run(out_dir: str, mode: str) -> None:
    sched_name, plant, *shapes = mode.split("-")
    rank = dist.get_rank()
    model = make_stage0() if rank == 0 else make_stage1()
    warm = bool(shapes)  # the schedule's first step (its shape inference) before the recorder
    stage = PipelineStage(model, rank, 2, torch.device("cpu"))
    crit = nn.CrossEntropyLoss()
    sched_cls = ScheduleGPipe if sched_name == "gpipe" else Schedule1F1B
    schedule = sched_cls(stage, n_microbatches=MICRO, loss_fn=crit)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    factory = f"pipeline_train:make_stage{rank}"
    steps = range(6)
    if warm:
        _one_step(rank, schedule, opt, *_batch(0, g, plant), 0)
        steps = range(1, 6)
    rec = contextlib.nullcontext() if plant == "bare" else FlightRecorder(
        model, opt, loss_fn=crit if rank == 1 else None, out_dir=out_dir, factory=factory,
        start_step=steps.start)
    try:
        with rec:
            for step in steps:
                x, y = _batch(step, g, plant)
                if plant == "last" and step == BAD_STEP and rank == 1:
                    with torch.no_grad():
                        model[0].bias[2] = -50.0
                _one_step(rank, schedule, opt, x, y, step)
        print(f"rank {rank} no event", flush=True)
    except NonFiniteError as e:
        ev = e.event
        print(f"rank {rank} event step={ev['step']} phase={ev['phase']} module={ev.get('module')}"
              f" samples={ev.get('samples')} first={ev.get('ranks', {}).get('first')} "
              f"bundle={e.bundle_path}", flush=True)


if __name__ == "__main__":
    modes.main(run, sys.argv[1], *sys.argv[2:])
