"""End to end: a module called twice in one forward (word_language_model's one ``nn.Dropout``,
after the encoder and after the RNN) has one absmax series per call in the history. With one
series for both, its second call's blow-up (the carried hidden state of a ReLU RNN whose
recurrent weight grows it) was reported as "absmax of drop jumped", the dropout before the
RNN, whose values never changed."""

from __future__ import annotations

import json

import lm_models as LM
import pytest
import torch
from bundles import invoke_cli

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def test_the_jump_is_named_at_the_rnn_and_the_dropout_call_after_it(tmp_path):
    model = LM.make_model()
    with torch.no_grad():  # a recurrent weight that grows the carried state 2x a step
        model.rnn.weight_hh_l0.copy_(torch.eye(LM.NHID) * 2.0)
        model.rnn.bias_hh_l0.fill_(0.5)
    crit = torch.nn.NLLLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, LM.NTOKEN, (2000, 4), generator=g)
    bptt = 20
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="lm_models:make_model"):
            hidden = torch.zeros(1, 4, LM.NHID)
            for i in range(0, len(data) - 1, bptt):
                x, y = data[i:i + bptt], data[i + 1:i + 1 + bptt].reshape(-1)
                hidden = hidden.detach()  # repackage_hidden
                opt.zero_grad()
                out, hidden = model(x, hidden)
                crit(out, y).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
                opt.step()
    r = invoke_cli(info.value.bundle_path, "--json")
    rep = json.loads(r.stdout)
    jumps = [p["detail"] for p in rep["precursors"] if p["kind"] == "absmax_jump"]
    assert jumps and jumps[0].startswith("absmax of rnn jumped"), rep["precursors"]
    assert "(drop (call 1), decoder, <root>)" in jumps[0], jumps[0]
    assert not any("absmax of drop" in j for j in jumps), jumps
