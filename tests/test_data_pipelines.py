"""Training fed by real ``torch.utils.data`` pipelines: batches that view a dataset's storage,
records corrupted late in a dataset, values missing as NaN that the model imputes."""

from __future__ import annotations

import json
from pathlib import Path

import data_pipelines_models as M
import pytest
import torch
from click.testing import CliRunner
from torch import nn
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError
from replay.cli import main as cli

HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
def _from_tests_dir(monkeypatch):
    monkeypatch.chdir(HERE)  # where data_pipelines_models.py, the factories' module, lives


def _replay(bundle, *args) -> tuple[int, dict]:
    res = CliRunner().invoke(cli, [str(bundle), "--json", *args])
    assert res.exit_code in (0, 1), res.output
    return res.exit_code, json.loads(res.stdout)


def test_a_batch_cleaned_in_place_after_the_forward_is_not_replayed_as_it_ran(tmp_path):
    """Batches are slices of the dataset's tensor (``batch_size=None``); after the backward
    the loop repairs the batch in place (``nan_to_num_``), which writes into the dataset too.
    The bundle, written when ``step()`` closed the step, held the repaired batch: the event
    named no tensor ('the input None') and the replay said 'reproduced' from a finite batch.
    Now the recorder notices the write (the input's version counter moved since the forward
    began) and says so, and the replay reports the recorded origin, not re-run, with why."""
    ds = M.Chunks(bad_row=9 * 32 + 5)
    model = M.make_regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    crit = nn.MSELoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="data_pipelines_models:make_regressor"):
            for x, y in DataLoader(ds, batch_size=None):
                opt.zero_grad()
                crit(model(x), y).backward()
                torch.nan_to_num_(x, nan=0.0)  # "clean" the record once it has been used
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (9, "input", "")
    assert "wrote into after the forward" in str(info.value), str(info.value)
    code, rep = _replay(info.value.bundle_path)
    assert code == 1 and rep["reproduced"] is False and rep["cause"] is None, rep
    assert rep["origin"]["phase"] == "input" and rep["not_rerun"] == \
        "input written after the forward", rep
    assert any("after the forward" in p for p in rep["problems"]), rep["problems"]


def test_a_batch_written_after_a_healthy_step_changes_nothing(tmp_path):
    """The same loop on clean data: no event, and training computes what it computes
    without the recorder."""
    def train(record: bool) -> list[float]:
        ds, model = M.Chunks(), M.make_regressor()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        crit, losses = nn.MSELoss(), []
        rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                             factory="data_pipelines_models:make_regressor")
        if record:
            rec.attach()
        for x, y in DataLoader(ds, batch_size=None):
            opt.zero_grad()
            loss = crit(model(x), y)
            loss.backward()
            x.mul_(1.0)
            opt.step()
            losses.append(loss.item())
        rec.detach()
        return losses

    assert train(True) == train(False)
    assert not list(tmp_path.glob("*.nan"))


def test_allow_inf_names_a_positional_input_as_the_docs_write_it(tmp_path):
    """A collate_fn returns an additive padding mask (0 / -inf) passed as the second argument,
    ``model(tokens, mask)``; under ``strict_inf=True`` the guide says to allow it by its name,
    ``args[1]``. fnmatch read ``[1]`` as a character class (matching ``args1``), so the
    pattern never matched and every step stopped at step 0 as bad input. A name equal to a
    pattern now matches it."""
    loader = DataLoader(M.Sequences(), batch_size=16, shuffle=True, num_workers=2,
                        collate_fn=M.pad_with_additive_mask,
                        generator=torch.Generator().manual_seed(0))
    model = M.make_attention_pool()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss()
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path, strict_inf=True,
                        allow_inf=["args[1]"],
                        factory="data_pipelines_models:make_attention_pool") as rec:
        for tokens, mask, y in loader:
            opt.zero_grad()
            crit(model(tokens, mask), y).backward()
            opt.step()
    assert rec.event is None and rec.step == 6
    assert not list(tmp_path.glob("*.nan"))
