"""Speech training as ASR repositories write it (``audio_models``), end to end: the recorder
on a CTC loop, then ``nanreplay --json --try`` on its bundle, through the command line."""

from __future__ import annotations

import json
from pathlib import Path

import audio_models as A
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from replay.cli import main as cli

HERE = Path(__file__).parent
K, ROW = 2, 3  # the step with an empty clip, and its row


@pytest.fixture(autouse=True)
def _from_tests_dir(monkeypatch):
    monkeypatch.chdir(HERE)  # where audio_models.py, the factory's module, lives


def train_ctc(out_dir: Path, steps: int = 4) -> NonFiniteError:
    torch.manual_seed(0)
    model = A.make_tiny_asr()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ctc = nn.CTCLoss(blank=0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=ctc, out_dir=out_dir,
                            factory="audio_models:make_tiny_asr"):
            for step in range(steps):
                wav, lens, targets, target_lens = A.batch(step, empty=ROW if step == K else None)
                opt.zero_grad()
                log_probs, out_lens = model(wav, lens)
                ctc(log_probs.transpose(0, 1), targets, out_lens, target_lens).backward()
                opt.step()
    return info.value


def nanreplay_json(bundle: Path, *args: str) -> dict:
    res = CliRunner().invoke(cli, [str(bundle), "--json", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_an_empty_clip_is_named_by_the_division_not_by_the_batchnorm_after_it(tmp_path):
    """An empty clip makes the per-utterance mean 0/0 in its row only, in the model's own
    forward; BatchNorm then spreads the NaN to every row of the model output. The samples are
    the division's ([3]); they were every row (the root call's output), so ``--try auto``
    proposed no ``drop``."""
    err = train_ctc(tmp_path)
    assert err.event["step"] == K and err.event["module"] == ""
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("forward", "", "aten.div", [ROW], "invalid"), json.dumps(rep, indent=1)
    assert o["all_samples"] is False and rep["reproduced"] is True
    assert o["source"].startswith("audio_models.py:"), o["source"]


def test_drop_redoes_the_transpose_the_loop_gave_ctc_loss(tmp_path):
    """``--try auto`` drops the empty clip: the loop's loss takes ``log_probs.transpose(0, 1)``,
    a view of the model output, which the re-run with a smaller batch redoes on its output.
    The what-if failed with a stride error (the recorded strides of the larger batch)."""
    err = train_ctc(tmp_path)
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    [what_if] = rep["what_if"]
    assert what_if["try"] == f"drop={ROW}" and what_if["finite"] is True, what_if
    assert what_if["inconclusive"] is False, what_if
