"""Train a small classifier with the flight recorder on, hit the planted NaN, and replay it.

Run from the repository root:  python examples/train_toy.py
"""

import shutil
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from toy_model import make_model  # noqa: E402

from recorder import FlightRecorder, NonFiniteError  # noqa: E402

OUT = Path("nan-bundles")


def batches(n_steps: int, batch: int = 16, d_in: int = 32):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(d_in, 4, generator=g)
    for step in range(n_steps):
        x = torch.randn(batch, d_in, generator=g)
        if step == 37:
            x[5] = 0.0  # a blank record the data pipeline filled with zeros
        yield x, (x @ w).argmax(dim=1)


def main() -> int:
    torch.manual_seed(0)
    shutil.rmtree(OUT, ignore_errors=True)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    criterion = nn.CrossEntropyLoss()
    try:
        with FlightRecorder(model, optimizer, loss_fn=criterion, out_dir=OUT,
                            factory="toy_model:make_model"):
            for step, (x, y) in enumerate(batches(100)):
                optimizer.zero_grad()
                loss = criterion(model(x), y)
                loss.backward()
                optimizer.step()
                if step % 10 == 0:
                    print(f"step {step:3d}  loss {loss.item():.4f}")
    except NonFiniteError as e:
        print(f"\n{e}\n")
        bundle = str(e.bundle_path)
    else:
        print("no NaN: the planted bug did not fire")
        return 1
    # What a user does next: look at the bundle, then replay it (from where the factory lives).
    here = Path(__file__).parent
    bundle = str(Path(bundle).resolve())
    subprocess.run([sys.executable, "-m", "replay", "--info", bundle], cwd=here, check=True)
    print()
    return subprocess.run([sys.executable, "-m", "replay", bundle], cwd=here).returncode


if __name__ == "__main__":
    sys.exit(main())
