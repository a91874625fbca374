"""A ``transformers.Trainer`` run on two CPU ranks (torchrun, gloo) with the recorder's callback
in ``on_event="warn"`` mode, launched from tests/test_torchrun.py.

accelerate hands rank r the global batches r, r + 2, ... in dataset order (sequential sampler),
so the all-padding batch 7 is rank 1's step 3: with tokens counted per rank, its loss is 0/0
there. The gradients stay finite (ignored tokens get zero gradient), so rank 0's own values
are finite; the ranks' per-step agreement tells it of rank 1's event at the same step, and in
warn mode each writes its bundle (rank 0's a peer event) and both ranks train on.
"""

import os
import sys
from pathlib import Path

import torch
from transformers import Trainer, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: hf_models
import hf_models as H  # noqa: E402

from recorder.huggingface import FlightRecorderCallback  # noqa: E402

BATCH = 4


class InOrder(Trainer):
    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)


def main(out_dir: str) -> None:
    torch.manual_seed(0)
    args = TrainingArguments(output_dir=str(Path(out_dir) / "out"), per_device_train_batch_size=BATCH,
                             max_steps=6, learning_rate=1e-3, report_to=[], save_strategy="no",
                             use_cpu=True, disable_tqdm=True, logging_strategy="no", seed=0,
                             ddp_backend="gloo", average_tokens_across_devices=False)
    cb = FlightRecorderCallback(out_dir=out_dir, factory="hf_models:make_tiny_gpt2",
                                on_event="warn")
    trainer = InOrder(model=H.make_tiny_gpt2(), args=args, callbacks=[cb],
                      train_dataset=H.Tokens(padding=range(7 * BATCH, 8 * BATCH)))
    rank = args.process_index
    trainer.train()
    rec = cb.recorder
    ev = rec.event or {}
    print(f"rank {rank} steps={rec.step} event={ev.get('step')}/{ev.get('phase')} "
          f"bundle={rec.bundle_path}", flush=True)
    # The Trainer leaves the process group up; gloo's threads torn down by interpreter exit
    # aborted a rank now and then ("terminate called without an active exception"). Both
    # ranks meet first: destroying it while the other rank still trained hung.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    # Leave before main's locals (the model, DDP's reducer, the process group) are torn down:
    # that teardown hung a rank now and then under a loaded machine, after the run was done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
