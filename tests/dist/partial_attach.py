"""Two ranks under torchrun, a recorder attached on rank 0 only, launched by
tests/test_torchrun.py with NANREPLAY_ATTACH_TIMEOUT=3: rank 0's attach must fail in one line
naming rank 1 within seconds, not wait until the process group's timeout."""

import os
import sys
import time

import torch.distributed as dist
from torch import nn

from recorder import FlightRecorder


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = nn.Linear(4, 2)
    if rank == 0:
        start = time.monotonic()
        try:
            FlightRecorder(model, out_dir=out_dir).attach()
            print("rank 0 attached", flush=True)
        except RuntimeError as e:
            print(f"rank 0 waited={time.monotonic() - start:.1f} error {e}", flush=True)
    dist.barrier()  # (rank 1 waits here meanwhile)
    dist.destroy_process_group()
    # Leave before main's locals (the model, the process group) are torn down: that teardown
    # hung a rank now and then under a loaded machine, after the run was done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
