"""Speech training as ASR repositories write it (``audio_models``), end to end: the recorder
on a CTC loop, then ``nanreplay --json --try`` on its bundle, through the command line."""

from __future__ import annotations

import json
from pathlib import Path

import audio_models as A
import pytest
import torch
from bundles import nanreplay_json
from click.testing import CliRunner
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from replay.cli import main as cli

K, ROW = 2, 3  # the step with an empty clip, and its row


pytestmark = pytest.mark.usefixtures("in_tests_dir")


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


def train_kws(out_dir: Path, silent_step: int, steps: int = 4) -> NonFiniteError:
    torch.manual_seed(0)
    model = A.make_peak_norm_kws()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="audio_models:make_peak_norm_kws"):
            for step in range(steps):
                wav = A.batch(step)[0]
                if step == silent_step:
                    wav[ROW] = 0.0  # a silent clip
                opt.zero_grad()
                crit(model(wav), torch.arange(6) % 5).backward()
                opt.step()
    return info.value


def test_a_forward_that_writes_into_its_input_is_replayed_from_the_input_as_it_came(tmp_path):
    """``wav.div_(peak)`` in the forward makes 0/0 on a silent clip. The bundle held the batch
    as the forward left it (NaN in row 3), so the replay said ``input`` (bad data); and each
    re-run wrote into the bundle's batch again, so the op finder named a later op. The recorder
    saw the write at step 0 and copies the inputs from then on; the replay gives each re-run a
    fresh copy: the origin is ``aten.div_`` in the root, on sample 3, ``invalid``."""
    err = train_kws(tmp_path, silent_step=K)
    assert err.event["step"] == K and err.event["phase"] == "forward", err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("forward", "", "aten.div_", [ROW], "invalid"), json.dumps(rep, indent=1)
    assert rep["reproduced"] is True and rep["bisection"]["agrees"] is True
    assert not any("wrote into its input" in p for p in rep["problems"]), rep["problems"]


def test_a_write_into_the_input_at_the_first_step_is_not_blamed_on_the_data(tmp_path):
    """At the first step the recorder has not yet seen the forward write into its input: the
    bundle holds what the forward left (NaN in row 3), which the replay took for bad data
    (``input``). It now says the step cannot be re-run from it, and reports what the recorder
    saw: the root made the NaN from finite inputs."""
    err = train_kws(tmp_path, silent_step=0)
    res = CliRunner().invoke(cli, [str(err.bundle_path), "--json"])
    assert res.exit_code == 1, res.output
    rep = json.loads(res.stdout)
    o = rep["origin"]
    assert (o["phase"], o["module"], rep["cause"], rep["not_rerun"]) == \
        ("forward", "", None, "input written by the forward"), json.dumps(rep, indent=1)
    assert any(p.startswith("the model's forward wrote into its input in place (micro-batch 0)")
               for p in rep["problems"]), rep["problems"]
