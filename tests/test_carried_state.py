"""Truncated BPTT with the recurrent state carried between steps: a batch-first ``nn.LSTM``'s
``(h, c)`` are ``(layers, B, H)``, the batch in dim 1 whatever ``batch_first`` says. The
samples of a NaN in that state, and ``--try drop=`` of them, must follow the batch there."""

from __future__ import annotations

import json
from pathlib import Path

import carried_models as CM
import pytest
import torch
from bundles import invoke_cli

from recorder import FlightRecorder, NonFiniteError

B, T = 6, 10


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def train(out_dir: Path) -> NonFiniteError:
    """Chunks of a token stream; between chunks the loop detaches the state and, as a
    stateful model's loop may, rescales each row of ``h`` to unit norm, resetting the rows
    of the streams that ended (multiplied by 0) first: a reset row is 0 / 0."""
    torch.manual_seed(0)
    model = CM.make_char_lstm()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    crit = CM.ChunkLoss()
    text = torch.randint(0, CM.V, (B, 8 * T + 1))
    hc = None
    with pytest.raises(NonFiniteError) as info, \
            FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                           factory="carried_models:make_char_lstm"):
        for step in range(8):
            x, y = text[:, step * T:(step + 1) * T], text[:, step * T + 1:(step + 1) * T + 1]
            if hc is not None:
                keep = torch.ones(1, B, 1)
                if step == 5:
                    keep[0, 3] = 0.0  # stream 3 ended
                h, c = (s.detach() * keep for s in hc)
                hc = (h / h.norm(dim=-1, keepdim=True), c)
            out = model(x, hc)
            hc = out[1]
            loss = crit(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return info.value


def test_a_nan_in_the_carried_state_names_its_sample_and_drops_it(tmp_path):
    err = train(tmp_path)
    ev = err.event
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == (
        5, "input", "args[1][0]", [3]), ev
    r = invoke_cli(err.bundle_path, "--json", "--try", "auto")
    rep = json.loads(r.stdout)
    o = rep["origin"]
    assert (rep["cause"], o["tensor"], o["samples"]) == ("input", "args[1][0]", [3]), o
    [t] = rep["what_if"]
    assert (t["try"], t["finite"], t.get("error")) == ("drop=3", True, None), t


def exploding_lm(out_dir: Path) -> Path:
    """pytorch/examples' word language model (RNN_RELU), its hidden state carried between
    truncated-BPTT chunks, trained by SGD at a learning rate 10x its default 20 and without
    its clip: the ReLU recurrence explodes until addmm overflows float32 at step 2."""
    import lm_models as LM
    torch.manual_seed(0)
    model = LM.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=200.0)
    crit = torch.nn.NLLLoss()
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, LM.NTOKEN, (20 * 35 + 1, 10), generator=g)
    hidden = torch.zeros(1, 10, LM.NHID)
    with pytest.raises(NonFiniteError) as info, \
            FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, rewind=8,
                           factory="lm_models:make_model"):
        for i in range(0, 20 * 35, 35):
            x, y = data[i:i + 35], data[i + 1:i + 36].reshape(-1)
            out, hidden = model(x, hidden.detach())
            loss = crit(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert (info.value.event["step"], info.value.event["module"]) == (2, "rnn")
    return info.value.bundle_path


def test_a_finite_what_if_whose_loss_still_explodes_is_marked_diverging(tmp_path):
    """float64 holds the word model's overflow, so ``--try dtype=float64`` stays finite
    through the event step, with a loss ~1e150: that try must say it still diverges (it read
    as a fix), while the learning rate's own try, whose loss stays near the calm steps', must
    not."""
    bundle = exploding_lm(tmp_path)
    rep = json.loads(invoke_cli(bundle, "--json", "--try", "dtype=float64",
                                "--try", "lr=0.01x").stdout)
    wide, low = rep["what_if"]
    assert wide["finite"] is True and wide["diverging"]["ratio"] > 1e3, wide
    assert low["finite"] is True and low["diverging"] is None, low
    text = invoke_cli(bundle, "--try", "dtype=float64").stdout
    assert "still diverging" in text, text


def test_an_overflow_right_after_the_weights_jumped_is_hinted_as_a_diverging_run(tmp_path):
    """The word model's update at step 1 blew its weights up 3.8e4x (a ``weight_jump`` listed
    at step 2: the norm the update before step 2 left), and step 2's forward overflowed. The
    hint must say the run was diverging and point at the learning rate (it said only 'compute
    it in float64', since the jump is listed at the event step itself)."""
    rep = json.loads(invoke_cli(exploding_lm(tmp_path), "--json").stdout)
    assert rep["cause"] == "overflow", json.dumps(rep, indent=1)
    # (the gradient norm's jump at step 1, before the weights', is the first sign)
    assert [p["kind"] for p in rep["precursors"] if p["step"] < 2] == ["grad_norm_jump"], \
        rep["precursors"]
    assert "the run was diverging" in rep["hint"] and "--try lr=0.1x" in rep["hint"], \
        rep["hint"]
