"""Spiking networks as snntorch users train them: the membrane potential lives on the neuron
modules as a plain attribute, replaced at every time step and reset by the loop before each
batch. The replay's re-runs must each start from that state as the step began, or the second
re-run starts where the first left it and the step reads as nondeterministic."""

from __future__ import annotations

import json

import pytest
import snn_models as S
import torch
from bundles import nanreplay_json
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def test_spike_counts_normalised_over_a_silent_output_name_the_silent_samples(tmp_path):
    """The loss turns output spike counts into probabilities by dividing by their sum; a
    sample whose output layer never fired is 0/0. The replay said "NOT reproduced: two
    re-runs disagree, nondeterminism": its first re-run left each neuron's ``mem`` on the
    module, and the second started from it. Now both re-runs start from the state the step
    began with, and the report names the loss's division on exactly the silent samples
    (recomputed here with the step's draw)."""
    torch.manual_seed(0)
    model = S.make_snn()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    crit = S.SpikeRateNLL()
    loader = DataLoader(TensorDataset(*S.data(256, 0)), batch_size=64, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="snn_models:make_snn"):
            for x, y in loader:
                S.reset(model)
                rng = torch.get_rng_state()
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    torch.set_rng_state(rng)
    S.reset(model)
    with torch.no_grad():
        silent = torch.nonzero(model(x).sum(0).sum(1) == 0).flatten().tolist()
    assert 0 < len(silent) < len(x), silent
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] is True, json.dumps(rep, indent=1)
    assert (o["phase"], o["module"], o["op"], rep["cause"]) == \
        ("loss", "<loss>", "aten.div", "invalid"), json.dumps(rep, indent=1)
    assert o["samples"] == silent, (o["samples"], silent)
