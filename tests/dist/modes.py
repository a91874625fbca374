"""One torchrun launch that runs several of a script's modes in turn (a launch costs each
rank a Python start and a rendezvous, several seconds here). Each mode gets its own bundle
directory ``OUT/<mode>``, a fresh model and recorder from ``run``, fresh warning registries,
and its own output files ``OUT/logs/<mode>-rank<r>.{out,err}`` (every write to the ranks'
stdout and stderr, Python's and C's), which tests/test_torchrun.py reads per mode. A mode
``script:name`` runs another script's ``run`` (its mode ``name``) in the same launch."""

import importlib
import os
import sys
import traceback
import warnings
from collections.abc import Callable

import torch.distributed as dist


def main(run: Callable[[str, str], None], out_dir: str, *modes: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    logs = os.path.join(out_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    code = 0
    try:
        for mode in modes:
            with warnings.catch_warnings():  # (each mode warns as a fresh process would)
                _to_files(os.path.join(logs, f"{mode}-rank{rank}"),
                          lambda mode=mode: _runner(run, mode)(os.path.join(out_dir, mode)))
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        dist.destroy_process_group()
    # Leave before the modes' leftovers (models, DDP's reducers) are torn down: that teardown
    # hung a rank now and then under a loaded machine, after the run was done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _runner(run: Callable[[str, str], None], mode: str) -> Callable[[str], None]:
    script, _, name = mode.rpartition(":")
    own = importlib.import_module(script).run if script else run
    return lambda out: own(out, name)


def _to_files(stem: str, fn: Callable[[], None]) -> None:
    """``fn()`` with file descriptors 1 and 2 sent to ``stem.out`` and ``stem.err``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(stem + ".out", "w") as out, open(stem + ".err", "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            fn()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
