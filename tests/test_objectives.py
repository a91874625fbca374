"""Training objectives outside vision and NLP, trained as their users write them, with a
planted numerical bug: the recorder fires at the planted step and ``nanreplay --json`` names
the module, op, samples and cause a numerics expert would name.
"""

from __future__ import annotations

import json
from pathlib import Path

import objective_models as O
import pytest
import torch
from bundles import nanreplay_json

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def table(step: int, n: int = 16, d: int = 6):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(n, d, generator=g)
    return x, x[:, 0] * 2 + 0.3 * torch.randn(n, generator=g)


def train_hetero(out_dir: Path, eps: float) -> NonFiniteError:
    """Train the heteroscedastic regressor under ``GaussianNLLLoss(eps)`` until the recorder
    raises: at step 3 row 5 holds an unnormalised reading (1e5, of the sign that drives the
    variance head's argument below -1000, where softplus is 0 even in float64)."""
    model = O.make_hetero()
    with torch.no_grad():
        probe = torch.zeros(2, 6)
        probe[0, 3], probe[1, 3] = 1e5, -1e5
        sign = 1e5 if float(model.var_head(model.body(probe))[0]) < 0 else -1e5
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = O.GaussianNLL(eps=eps)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="objective_models:make_hetero"):
            for step in range(6):
                x, y = table(step)
                if step == 3:
                    x[5, 3] = sign
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    return info.value


def test_a_softplus_variance_that_underflowed_to_0_is_underflow_in_the_loss(tmp_path):
    """A heteroscedastic regressor's variance head is softplus of a Linear; an unnormalised
    reading (1e5) in one row drives its argument below -1000, where softplus is 0 even in
    float64, and ``GaussianNLLLoss(eps=0)`` takes the log of that 0: a loss event. The 0 was
    made by the model's softplus, before the loss ran: a positive value that underflowed,
    not a 0 that exact arithmetic makes (``invalid``)."""
    err = train_hetero(tmp_path, eps=0.0)
    assert err.event["step"] == 3 and err.event["phase"] == "loss"
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("loss", "<loss>", "aten.log", [5], "underflow"), json.dumps(rep, indent=1)
    assert "softplus" in rep["hint"] and "exact arithmetic makes" not in rep["hint"], rep["hint"]


def test_auto_does_not_drop_most_of_the_batch(tmp_path):
    """``PoissonNLLLoss(log_input=False)`` on a rate head with no positive activation: the log
    of negative rates in 15 of 16 rows, ``invalid``. Dropping those rows makes the step finite
    and proves nothing (the next batch fails the same way): ``--try auto`` proposed it; it is
    kept for a few bad records and left out when most of the batch is named."""
    model = O.make_count_regressor()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = torch.nn.PoissonNLLLoss(log_input=False)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="objective_models:make_count_regressor"):
            for step in range(3):
                x, _ = table(step)
                opt.zero_grad()
                crit(model(x), torch.poisson(x[:, 0].exp())).backward()
                opt.step()
    rep = nanreplay_json(info.value.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (o["phase"], o["op"], rep["cause"]) == ("loss", "aten.log", "invalid"), o
    assert 2 * len(o["samples"]) > o["batch_size"], o
    assert not any(t["try"].startswith("drop=") for t in rep.get("what_if") or []), rep


def test_a_minus_infinity_target_the_loss_made_nan_of_names_the_loss_op(tmp_path):
    """Distillation over a label space that shrank at step 3: the teacher's logits of the
    dropped classes are masked to -inf, so its log-probabilities there are -inf (a probability
    of exactly 0, on purpose). ``KLDivLoss(log_target=True)`` computes exp(t) * (t - x): 0 *
    -inf, NaN. The event is the loss target's -inf (``input``); the hint said only 'check the
    data pipeline', and now names the loss's op that made NaN of it and what avoids it."""
    torch.manual_seed(0)
    teacher = torch.nn.Linear(6, 5)
    model = O.make_student()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    crit = O.DistillLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="objective_models:make_student"):
            for step in range(6):
                x, _ = table(step)
                with torch.no_grad():
                    logits = teacher(x)
                    if step >= 3:
                        logits[:, 3:] = float("-inf")
                    target = torch.log_softmax(logits / crit.temperature, -1)
                opt.zero_grad()
                crit(model(x), target).backward()
                opt.step()
    assert info.value.event["step"] == 3
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["tensor"], o["made"], rep["cause"]) == \
        ("input", "loss_args[1]", "-inf", "input"), json.dumps(rep, indent=1)
    hint = rep["hint"]
    assert "aten.mul" in hint and "0 * inf" in hint and "log_target=False" in hint, hint


def test_a_gradient_overflow_near_a_division_pole_says_to_raise_the_eps(tmp_path):
    """The same regressor under ``GaussianNLLLoss(eps=1e-30)``: the variance is clamped to
    1e-30, the loss is finite, and the derivative of (y - mean)² / var, -(y - mean)² / var²,
    is beyond float32 (finite in float64): ``overflow`` at DivBackward0 on the row that drove
    the variance down. The hint said 'subtract the row max before exp, normalise before a
    product'; it now says the division is near its pole and the eps is too small."""
    err = train_hetero(tmp_path, eps=1e-30)
    assert err.event["step"] == 3 and err.event["phase"] == "backward"
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("backward", "<loss>", "DivBackward0", [5], "overflow"), json.dumps(rep, indent=1)
    assert "pole" in rep["hint"] and "eps" in rep["hint"], rep["hint"]
    assert "row max" not in rep["hint"], rep["hint"]


def bags(step: int, n: int = 12):
    """``n`` bags of 1 to 5 item ids: (ids, offsets, tf-idf weights, labels)."""
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(1, 6, (n,), generator=g)
    ids = torch.randint(0, 200, (int(lengths.sum()),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    return ids, offsets, torch.rand(len(ids), generator=g) + 0.5, (ids[offsets] % 2).float()


def test_an_embedding_bag_input_names_its_bags_and_drop_removes_them(tmp_path):
    """tf-idf weights for ``EmbeddingBag(per_sample_weights=)``: an item no idf document
    holds gets log(N / 0) = +inf. The weights are flat (one per id, not per sample), so the
    event and the report named no samples ([]); they name the bags holding those ids
    (through the offsets), and ``--try drop`` of those bags removes their ids, weights and
    offsets, and the step is finite."""
    model = O.make_bag_of_words()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = torch.nn.BCEWithLogitsLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="objective_models:make_bag_of_words"):
            for step in range(6):
                ids, offsets, weights, y = bags(step)
                if step == 3:
                    weights[offsets[4] + 0] = float("inf")
                    weights[offsets[9] + 0] = float("inf")
                opt.zero_grad()
                crit(model(ids, offsets, weights), y).backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["samples"]) == (3, "input", [4, 9])
    rep = nanreplay_json(err.bundle_path, "--try", "drop=4,9", "--try", "drop=4")
    o = rep["origin"]
    assert (o["tensor"], o["samples"], rep["cause"]) == ("args[2]", [4, 9], "input"), o
    tries = {t["try"]: t["finite"] for t in rep["what_if"]}
    assert tries == {"drop=4,9": True, "drop=4": False}, rep["what_if"]


@pytest.mark.parametrize("rewind", [None, 4])
def test_an_overflow_after_the_run_grew_says_the_run_was_diverging(tmp_path, rewind):
    """Least squares on features that were never standardised (scale 10), SGD at 0.02: the
    loss and gradient norm jump from step 2 and a Linear's addmm overflows at step 4. The
    hint said only 'rescale its inputs ... or compute it in float64' (and --try dtype=float64
    is finite at that step), which postpones the overflow; it now says the run was diverging
    and to lower the learning rate or clip, as the precursors show. Only a bundle without a
    rewind window is told to record with ``rewind=N``: one recorded with it was told so too."""
    model = O.make_unscaled_regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    crit = torch.nn.MSELoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path, rewind=rewind,
                            factory="objective_models:make_unscaled_regressor"):
            for step in range(20):
                x = table(step)[0] * 10
                opt.zero_grad()
                crit(model(x), x[:, 0] * 3).backward()
                opt.step()
    rep = nanreplay_json(info.value.bundle_path)
    assert rep["cause"] == "overflow" and rep["event"]["step"] == info.value.event["step"], rep
    assert "diverging" in rep["hint"] and "learning rate" in rep["hint"], rep["hint"]
    # said once: with a window, by its measured weight growth (it said it twice, in two
    # wordings, the precursors' and the window's)
    assert rep["hint"].count("the run was diverging") == 1, rep["hint"]
    assert ("the weight norm grew" in rep["hint"]) == (rewind is not None), rep["hint"]
    assert ("had jumped at step" in rep["hint"]) == (rewind is None), rep["hint"]
    assert any(p["kind"] == "loss_jump" for p in rep["precursors"]), rep["precursors"]
    assert ("record with FlightRecorder(..., rewind=N)" in rep["hint"]) == (rewind is None)
    assert ("--try lr=0.1x and clip=1.0 re-run the bundle's rewind window" in rep["hint"]) \
        == (rewind is not None), rep["hint"]


def test_an_input_event_names_the_loss_target_the_recorder_named(tmp_path):
    """Matrix factorisation under SparseAdam (given to the recorder) and Adam, each rating
    weighted by 1 / sqrt(the user's rating count): a user with none gets +inf, in the
    prediction ``model(u, i) * w`` and in the target ``r * w``. The recorder names the target,
    ``loss_args[1]`` (the prediction is computed from the model output, not data); the replay
    named ``loss_args[0]``, the prediction, with its -inf."""
    model = O.make_matrix_factorisation()
    sparse = torch.optim.SparseAdam([model.user.weight, model.item.weight], lr=1e-2)
    dense = torch.optim.Adam([model.bias], lr=1e-2)
    crit = torch.nn.MSELoss()
    counts = torch.arange(50).float() % 7 + 1
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, sparse, loss_fn=crit, out_dir=tmp_path,
                            factory="objective_models:make_matrix_factorisation"):
            for step in range(6):
                g = torch.Generator().manual_seed(step)
                users, items = torch.randint(0, 50, (16,), generator=g), \
                    torch.randint(0, 60, (16,), generator=g)
                if step == 3:
                    users[6], counts[users[6]] = 11, 0.0  # a user with no rating in the split
                w = 1 / counts[users].sqrt()
                sparse.zero_grad()
                dense.zero_grad()
                crit(model(users, items) * w, torch.rand(16, generator=g) * 5 * w).backward()
                sparse.step()
                dense.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == \
        (3, "input", "loss_args[1]", [6]), ev
    o = nanreplay_json(info.value.bundle_path)["origin"]
    assert (o["phase"], o["tensor"], o["made"], o["samples"]) == \
        ("input", "loss_args[1]", "+inf", [6]), o


def test_a_sigmoid_probability_that_underflowed_under_log_points_at_the_logits(tmp_path):
    """A hand-written binary cross entropy on a model that outputs sigmoid probabilities: a
    record 1e4x out of scale saturates the sigmoid to exactly 0 (its logit is below -104),
    and log(0) is -inf in the loss. The 0 came from the model's sigmoid: ``underflow``; the
    hint named log_softmax and logsumexp only, and now names the fix for a sigmoid
    (logsigmoid, or BCEWithLogitsLoss on the logits)."""
    model = O.make_click_model()
    record = table(0)[0][0]
    with torch.no_grad():  # which sign of the record sends the logit furthest down
        logits = model[:3](torch.stack([record, -record]) * 1e4).flatten()
        scale = 1e4 if float(logits[0]) < float(logits[1]) else -1e4
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = O.bce
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=tmp_path,
                            factory="objective_models:make_click_model") as rec:
            for step in range(6):
                x = table(step)[0]
                if step == 3:
                    x[5] = record * scale
                opt.zero_grad()
                rec.loss_fn(model(x), (x[:, 0] > 0).float()).backward()
                opt.step()
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (info.value.event["step"], o["phase"], o["op"], o["samples"], rep["cause"]) == \
        (3, "loss", "aten.log", [5], "underflow"), json.dumps(rep, indent=1)
    assert "BCEWithLogitsLoss" in rep["hint"], rep["hint"]
