"""A Hugging Face ``Trainer`` run with the flight recorder's callback, a batch with every label
-100, and the replay. Needs ``pip install transformers accelerate`` (the test extras have them).

Run from the repository root:  python examples/hf_trainer.py

A tiny GPT-2 (built from a config, nothing downloaded) trains on random tokens. Batch 3 has
every label -100 (as prompts whose answers were truncated away have): transformers divides the
summed loss by the number of labelled tokens, 0 / 0. The recorder stops the step before the optimizer applies it, writes the bundle,
and ``nanreplay`` names the op and the line in transformers' loss code.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import torch

OUT = Path("nan-bundles")
VOCAB, CTX, BATCH, BAD_STEP = 61, 16, 4, 3


def make_model():
    """The factory: ``nanreplay`` rebuilds the model with it (``hf_trainer:make_model``)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB,
                                      n_positions=CTX, bos_token_id=0, eos_token_id=0))


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, VOCAB, (CTX,), generator=torch.Generator().manual_seed(i))
        unlabelled = i // BATCH == BAD_STEP  # a batch with no token to learn
        return {"input_ids": ids, "labels": torch.full_like(ids, -100) if unlabelled else ids}


def main() -> int:
    try:
        from transformers import Trainer, TrainingArguments
    except ImportError:
        print("this example needs transformers and accelerate: pip install transformers accelerate")
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout
    from recorder import NonFiniteError
    from recorder.huggingface import FlightRecorderCallback

    class InOrder(Trainer):  # batches in dataset order, so the unlabelled batch is step 3
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    torch.manual_seed(0)
    shutil.rmtree(OUT, ignore_errors=True)
    args = TrainingArguments(output_dir="hf-out", per_device_train_batch_size=BATCH, max_steps=10,
                             learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True,
                             disable_tqdm=True, logging_steps=1)
    trainer = InOrder(model=make_model(), args=args, train_dataset=Tokens(),
                      callbacks=[FlightRecorderCallback(out_dir=OUT,
                                                        factory="hf_trainer:make_model")])
    try:
        trainer.train()
    except NonFiniteError as e:
        print(f"\n{e}\n")
        bundle = str(Path(e.bundle_path).resolve())
    else:
        print("no NaN: the planted batch did not fire")
        return 1
    finally:
        shutil.rmtree("hf-out", ignore_errors=True)
    # replay from the directory where the factory lives
    return subprocess.run([sys.executable, "-m", "replay", bundle],
                          cwd=Path(__file__).parent).returncode


if __name__ == "__main__":
    sys.exit(main())
