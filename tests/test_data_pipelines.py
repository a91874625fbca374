"""Training fed by real ``torch.utils.data`` pipelines: batches that view a dataset's storage,
records corrupted late in a dataset, values missing as NaN that the model imputes."""

from __future__ import annotations

import data_pipelines_models as M
import pytest
import torch
from bundles import replay_report
from torch import nn
from torch.utils.data import DataLoader, WeightedRandomSampler

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle

pytestmark = pytest.mark.usefixtures("in_tests_dir")


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
    rep, code = replay_report(info.value.bundle_path)
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


def _train_imputing(tmp_path, *, record=True, leak=False, late_missing=None, **options):
    """Two epochs over a MissingTable read by two workers; the losses and the final weights."""
    loader = DataLoader(M.MissingTable(late_missing=late_missing), batch_size=32, shuffle=True,
                        num_workers=2, persistent_workers=True,
                        generator=torch.Generator().manual_seed(4))
    model = M.make_imputing(leak)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    crit, losses = nn.MSELoss(), []
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                         factory="data_pipelines_models:make_imputing",
                         factory_kwargs={"leak": leak}, **options)
    if record:
        rec.attach()
    try:
        for _ in range(2):
            for x, y in loader:
                opt.zero_grad()
                loss = crit(model(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
        rec.end_step()
    finally:
        rec.detach()
        # (an event raised mid-epoch leaves this frame in a reference cycle with the
        # exception; collected later, the persistent workers' queues close before the
        # iterator's shutdown can reach them, and it waits 5 s per worker)
        del loader
    return losses, [p.detach().clone() for p in model.parameters()]


def test_values_missing_as_nan_that_the_model_imputes_stop_the_run_saying_how_to_allow_them(
        tmp_path):
    """Tabular data with missing values as NaN, which the model's forward fills with a learned
    value (``torch.where(torch.isnan(x), fill, x)``): a NaN in a root input is an event, so
    the run stops at step 0, and it could not be allowed at all (``allow_inf`` takes no NaN),
    so the recorder could not be used on such a model. The event now says the model handled
    the NaN (its outputs, loss and gradients stayed finite) and names the option."""
    with pytest.raises(NonFiniteError) as info:
        _train_imputing(tmp_path)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["tensor"], ev["nan_handled"]) == \
        (0, "input", "batch", "args[0]"), ev
    assert "allow_nan=['args[0]']" in str(info.value), str(info.value)
    rep, code = replay_report(info.value.bundle_path)
    assert code == 0 and rep["cause"] == "input" and "allow_nan=['args[0]']" in rep["hint"], rep


def test_allow_nan_trains_an_imputing_model_exactly_as_without_the_recorder(tmp_path):
    """With ``allow_nan=["args[0]"]`` the same run trains on: no event, no bundle, and the
    losses and weights are bit-identical to a run without the recorder."""
    recorded = _train_imputing(tmp_path, allow_nan=["args[0]"])
    plain = _train_imputing(tmp_path, record=False)
    assert recorded[0] == plain[0] and len(recorded[0]) == 16
    assert all(torch.equal(a, b) for a, b in zip(recorded[1], plain[1]))
    assert not list(tmp_path.glob("*.nan"))


@pytest.mark.parametrize("strict_inf", [False, True])
def test_an_allowed_nan_that_gets_past_the_imputation_is_an_input_event(tmp_path, strict_inf):
    """The model feeds one raw column to the MLP without imputing it; that column is never
    missing until one late record. Its NaN reaches the first Linear: an ``input`` event on the
    batch at the step that brought the record (not a Linear 'whose inputs were finite', nor
    the root), naming that record's row only (the other rows' NaN was imputed), and the
    replay says the NaN got past the model's handling."""
    row = 200
    with pytest.raises(NonFiniteError) as info:
        _train_imputing(tmp_path, leak=True, late_missing=row, allow_nan=["args[0]"],
                        strict_inf=strict_inf)
    ev = info.value.event
    assert (ev["phase"], ev["module"], ev["tensor"]) == ("input", "", "batch"), ev
    assert "nan_handled" not in ev, ev
    rep, code = replay_report(info.value.bundle_path)
    assert code == 0 and rep["cause"] == "input", rep
    assert "got past that handling" in rep["hint"], rep["hint"]
    x = read_bundle(info.value.bundle_path)[1]["batch/0/0"]
    lost = torch.isnan(x[:, -1]).nonzero().flatten().tolist()  # the late record's row
    assert len(lost) == 1 and ev["samples"] == rep["origin"]["samples"] == lost, (ev, rep)


def test_a_forward_bug_beside_allowed_missing_values_is_named_not_blamed_on_the_data(tmp_path):
    """Missing values allowed (``allow_nan``) and imputed; a constant record makes 0/0 in a
    row normaliser. The recorder names the normaliser, and the replay must too: it blamed
    the batch ('the batch itself holds NaN/Inf') because the bundled batch holds the missing
    values' NaN."""
    ds = M.MissingTable()
    ds.x[70] = 3.0  # a constant record
    loader = DataLoader(ds, batch_size=32, num_workers=2)
    model = M.make_imputed_row_norm()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = nn.MSELoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path, allow_nan=["args[0]"],
                            factory="data_pipelines_models:make_imputed_row_norm"):
            for x, y in loader:
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (2, "forward", "norm"), ev
    rep, code = replay_report(info.value.bundle_path)
    o = rep["origin"]
    assert code == 0 and (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("forward", "norm", "aten.div", [70 - 64], "invalid"), rep


def test_a_corrupt_record_that_overflows_a_batch_norm_is_named_not_widened(tmp_path):
    """A record holding 3e38, oversampled by a WeightedRandomSampler, makes BatchNorm's
    variance overflow float32: every row of the batch is NaN. The report said only 'float64
    holds it: compute it in float64' and ``--try auto`` tried float64 alone, since the
    out-of-scale check looked at the named samples, here the whole batch. The rows whose data
    stands 10x above every other row's are now named, with ``drop`` proposed and tried."""
    bad = 517
    weights = torch.ones(600)
    weights[bad] = 20.0

    def sampler():
        return WeightedRandomSampler(weights, 600, generator=torch.Generator().manual_seed(7))

    order = list(sampler())
    step = next(i // 32 for i, k in enumerate(order) if k == bad)
    rows = [r for r, k in enumerate(order[32 * step:32 * step + 32]) if k == bad]
    loader = DataLoader(M.Features(corrupt=bad), batch_size=32, sampler=sampler(),
                        num_workers=2, persistent_workers=True)
    model = M.make_batch_norm_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="data_pipelines_models:make_batch_norm_mlp"):
            for x, y in loader:
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    del loader  # (now, not when the cycle with ``info`` is collected: see _train_imputing)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (step, "forward", "bn"), ev
    rep, code = replay_report(info.value.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert code == 0 and (o["module"], o["op"], rep["cause"], o["all_samples"]) == \
        ("bn", "aten.native_batch_norm", "overflow", True), rep
    which = ",".join(map(str, rows))
    assert f"sample(s) {which} of batch reach 3e+38" in rep["hint"], rep["hint"]
    tries = {t["try"]: t for t in rep["what_if"]}
    assert tries[f"drop={which}"]["finite"] is True, tries


@pytest.mark.parametrize("loss", ["nanmean_mse", "masked_mse"])
def test_labels_missing_as_nan_in_a_loss_that_skips_them_only_in_its_value(tmp_path, loss):
    """Multi-target regression whose missing targets are NaN. ``masked_mse`` selects the
    present ones before the op: it trains, no event. ``nanmean_mse`` skips them in the value
    only, so PowBackward0 multiplies their NaN: a backward event, whose cause the replay gave
    as 'invalid ... the op ran outside its domain (sqrt or log of a negative, 0/0)', though
    no op left its domain: the NaN came with the loss target, which the check for a NaN the
    forward carried looked for in the model's inputs only. It is now ``input``, naming the
    target and its rows, with the fix for a masked loss."""
    x, y = M.missing_labels()
    loader = DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, num_workers=2)
    model = M.make_multi_target()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with FlightRecorder(model, opt, loss_fn=getattr(M, loss), out_dir=tmp_path,
                        on_event="warn", factory="data_pipelines_models:make_multi_target") as rec:
        for xb, yb in loader:
            opt.zero_grad()
            rec.loss_fn(model(xb), yb).backward()
            opt.step()
    if loss == "masked_mse":
        assert rec.event is None and not list(tmp_path.glob("*.nan"))
        return
    assert (rec.event["step"], rec.event["phase"]) == (0, "backward"), rec.event
    rep, code = replay_report(rec.bundle_path)
    o = rep["origin"]
    rows = torch.isnan(y[:32]).any(1).nonzero().flatten().tolist()
    assert code == 0 and (o["phase"], o["module"], o["op"], rep["cause"], o["samples"]) == \
        ("backward", "<loss>", "PowBackward0", "input", rows), rep
    assert "came in with the loss target" in rep["hint"] and "loss_args[1]" in rep["hint"], rep
    assert "pred[mask]" in rep["hint"], rep["hint"]


def test_a_column_standardised_by_a_zero_std_is_named_as_a_column_not_as_records(tmp_path):
    """The pipeline standardises each feature with statistics of the data, without an eps;
    one column is constant (a sensor stuck at one value), so it is 0/0 = NaN in every row.
    The report said 'check the data pipeline for these samples' for all 32 rows, sending the
    user to the records; it now names the column, NaN in every sample, and the step to fix."""
    x = M.Features().x
    x[:, 4] = 7.0
    x = (x - x.mean(0)) / x.std(0)
    y = (x[:, 0] > 0).long()
    loader = DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True,
                        num_workers=2, generator=torch.Generator().manual_seed(0))
    model = M.make_batch_norm_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="data_pipelines_models:make_batch_norm_mlp"):
            for xb, yb in loader:
                opt.zero_grad()
                crit(model(xb), yb).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["tensor"]) == (0, "input", "batch"), ev
    rep, code = replay_report(info.value.bundle_path)
    assert code == 0 and rep["cause"] == "input" and rep["origin"]["all_samples"], rep
    assert "same feature(s) of every sample (column(s) 4," in rep["hint"], rep["hint"]


def test_micro_batches_copied_into_one_reused_buffer_are_replayed_as_they_ran(tmp_path):
    """Gradient accumulation over 4 micro-batches, each copied into one static input buffer
    (``static_x.copy_(x)``, as a loop prepared for CUDA graphs keeps). Every micro-batch's
    input was the same tensor, so the bundle held the last micro-batch's data four times and
    the replay re-ran the wrong rows. The recorder now notices the first write into an
    earlier micro-batch's input and keeps copies from then on: an all-zero record at step 5,
    micro-batch 1, row 5, is replayed and named."""
    x = torch.randn(512, M.D, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).long()
    x[16 * 21 + 5] = 0.0  # step 5 (4 micro-batches of 16), micro-batch 1, row 5
    loader = DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16, num_workers=2)
    model = M.make_unit_norm_classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.CrossEntropyLoss()
    static_x = torch.empty(16, M.D)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="data_pipelines_models:make_unit_norm_classifier"):
            for i, (xb, yb) in enumerate(loader):
                static_x.copy_(xb)
                (crit(model(static_x), yb) / 4).backward()
                if i % 4 == 3:
                    opt.step()
                    opt.zero_grad()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["micro_batch"], ev["samples"]) == \
        (5, "forward", "0", 1, [5]), ev
    rep, code = replay_report(info.value.bundle_path)
    o = rep["origin"]
    assert code == 0 and (o["module"], o["op"], o["micro_batch"], o["samples"], rep["cause"]) \
        == ("0", "aten.div", 1, [5], "invalid"), rep


def test_a_per_sample_loss_weighted_in_the_loop_is_replayed_not_a_crash(tmp_path):
    """The loss module is ``CrossEntropyLoss(reduction="none")``, given to the recorder; the
    loop weights each sample with the record's weight and averages (a NaN weight in record
    150). The replay called ``backward()`` on the per-sample loss and died: 'replay failed
    (RuntimeError: grad can be implicitly created only for scalar outputs)'. A loss of several
    values is now not backpropagated (the loop reduced it, the replay cannot know how): the
    recorded gradient of the output says where the NaN entered, and on which sample."""
    loader = DataLoader(M.WeightedRecords(bad=150), batch_size=32, num_workers=2)
    model = M.make_mlp3()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss(reduction="none")
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="data_pipelines_models:make_mlp3"):
            for b in loader:
                opt.zero_grad()
                (crit(model(b["x"]), b["y"]) * b["w"]).mean().backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (150 // 32, "backward"), ev
    rep, code = replay_report(info.value.bundle_path)
    o = rep["origin"]
    assert code == 0 and rep["reproduced"] and (o["phase"], o["samples"]) == \
        ("loss", [150 % 32]), rep
    assert "computed outside it" in rep["hint"], rep["hint"]
