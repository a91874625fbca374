"""End to end on Graves' handwriting synthesis (``handwriting_synthesis_models``): an LSTM cell
stepped over pen offsets with a soft attention window over the transcription, a second LSTM,
a mixture density output layer and the masked NLL of padded stroke sequences, trained with Adam,
an exponential learning-rate decay, gradient-norm clipping and Graves' derivative clipping
(gradient hooks the forward registers). Each planted bug of the domain fires under the recorder
and is replayed with the CLI; the healthy run raises no event and trains bit-identically with
and without the recorder."""

from __future__ import annotations

import contextlib

import handwriting_synthesis_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("handwriting_synthesis_models.py", text)


def planted(kind: str, batch, bad: int):
    """The step's batch with sample ``bad`` broken as ``kind`` says."""
    target, mask, chars, char_mask = batch
    if kind == "jump":  # an unclipped pen-up jump to the next word, in raw units
        target[bad, 5, :2] = torch.tensor([60.0, -4.0])
    elif kind == "empty":  # a stroke file that was empty after filtering
        target[bad], mask[bad] = 0.0, 0.0
    elif kind == "garbage_pad":  # a collate_fn's torch.empty: padded steps hold stale memory
        target[mask == 0] = 1e30
    elif kind == "dot":  # a line of one dot (the pen never moved), then each line scaled by
        target[bad, :, :2] = 0.0  # its own std, as the loop below does for this kind
        xy = target[..., :2]
        target = torch.cat([xy / xy.std(1, keepdim=True), target[..., 2:]], -1)
    elif kind == "no_text":  # a transcription whose characters were all outside the alphabet
        chars[bad], char_mask[bad] = 0.0, 0.0
    return target, mask, chars, char_mask


def train(make: str, loss: str, out_dir, kind: str | None = None, bad: int = 0,
          steps: int = 4, record: bool = True, amp: bool = False):
    """Adam with an exponential decay and clip_grad_norm_, as the ports train; the last
    step's batch is broken by ``kind``. Returns the model."""
    model = getattr(M, make)()
    if kind in ("rho", "rho_dist"):
        M.resume_correlated(model, 20.0 if amp else 40.0)
    elif kind == "collapsed":
        M.resume_collapsed(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.99)
    crit = getattr(M, loss)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"handwriting_synthesis_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            batch = M.strokes_batch(g)
            if kind is not None and step == steps - 1:
                batch = planted(kind, batch, bad)
            target, mask, chars, char_mask = batch
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                out = model(M.teacher_forced(target), chars, char_mask)
                value = loss_fn(*out, target, mask)
            opt.zero_grad()
            value.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    return model


def fire(make: str, loss: str, tmp_path, kind: str, bad: int):
    with pytest.raises(NonFiniteError) as info:
        train(make, loss, tmp_path, kind, bad)
    return info.value.event, info.value.bundle_path


def test_mixture_summed_in_probability_space_names_the_log_of_the_underflow(tmp_path):
    """Graves' eq. 26 written as printed, ``log(sum_j pi_j N_j)``: an unclipped pen-up jump of
    60 (raw units in a normalised line) puts every component's density below float32's range
    at that pen point, the sum is 0 and its log -inf. The replay names that log on the line
    holding the jump, underflow, logsumexp as the fix and the record as out of scale;
    dropping it makes the step finite."""
    ev, bundle = fire("make_synthesis", "mdn_loss_prob", tmp_path, "jump", bad=3)
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "loss", "+inf"), ev
    rep = nanreplay_json(bundle, "--try", "drop=3")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "<loss>", "aten.log", "-inf", [3]), o
    assert o["source"] == line_of("mix = torch.log((pi * torch.exp(log_n)).sum(-1))"), o
    assert rep["cause"] == "underflow", rep["cause"]
    assert "logsumexp" in rep["hint"] and "sample(s) 3" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_logsumexp_mixture_takes_the_same_jump_without_an_event(tmp_path):
    """The same batch under the logsumexp loss: a large but finite NLL, no event, and the
    recorder leaves the training bit-identical."""
    recorded = train("make_synthesis", "mdn_loss", tmp_path, "jump", bad=3)
    plain = train("make_synthesis", "mdn_loss", tmp_path, "jump", bad=3, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_per_line_mean_over_an_empty_stroke_file_names_the_division_and_the_line(tmp_path):
    """Each line's NLL divided by its own number of pen points: a line whose stroke file was
    empty has a mask of zeros, and the masked sum over it is 0 too, 0/0. The replay names
    the division of the loss, that line, invalid, an eps or skipping the empty rows, and the
    loss's mask argument that is empty in that line alone."""
    ev, bundle = fire("make_synthesis", "mdn_loss_per_line", tmp_path, "empty", bad=2)
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "loss", "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=2")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("<loss>", "aten.div", "nan", [2]), o
    assert o["source"] == line_of("return ((step_nll(out, target) * mask).sum(1) / mask.sum(1))"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "skip the rows where it is 0" in rep["hint"], rep["hint"]
    # (the data the line lacks: the loss's stroke mask, the 9th argument after 7 outputs)
    assert "Sample(s) 2 are empty records: loss_args[8] (0/1 data) has no entry" in rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_normalised_window_over_a_lost_transcription_names_the_window_call(tmp_path):
    """A port that divides the window's weights by their sum over the characters: a line
    whose transcription lost every character (all outside the alphabet) has a character mask
    of zeros, so phi is 0 and the division 0/0 at the first pen point. The recorder names
    the window's first call and the line; the replay the division on its line, and the
    model's inputs (characters, their mask) empty in that line alone."""
    ev, bundle = fire("make_normalised_window", "mdn_loss", tmp_path, "no_text", bad=6)
    assert (ev["step"], ev["phase"], ev["module"], ev["call"], ev["samples"]) == (
        3, "forward", "window", 0, [6]), ev
    rep = nanreplay_json(bundle, "--try", "drop=6")
    o = rep["origin"]
    assert (o["module"], o["call"], o["op"], o["samples"], o["inputs_finite"]) == (
        "window", 0, "aten.div", [6], True), o
    assert o["source"] == line_of("phi = phi / phi.sum(-1, keepdim=True)"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    # (the one-hot characters and their mask, both empty in that line alone)
    assert "Sample(s) 6 are empty records: args[1] and args[2] (0/1 data) have" in rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_line_scaled_by_its_own_std_of_a_dot_is_an_input_event_on_that_line(tmp_path):
    """The loop scales each line's offsets by their own std: a line that is one dot (the pen
    never moved) has std 0, and its offsets are 0/0 before the model sees them. The recorder
    stops at the input, on that line; the replay says the batch holds the NaN, points at a
    normalisation's division, and dropping the line makes the step finite."""
    ev, bundle = fire("make_synthesis", "mdn_loss", tmp_path, "dot", bad=4)
    assert (ev["step"], ev["phase"], ev["samples"], ev["kind"]) == (3, "input", [4], "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=4")
    o = rep["origin"]
    assert (o["phase"], o["tensor"], o["samples"], rep["cause"]) == (
        "input", "args[0]", [4], "input"), rep
    assert "division by zero in normalisation" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def padded_rows(step: int = 3) -> list[int]:
    """The lines of step ``step``'s batch shorter than the longest possible (those with padded
    pen points), read from the batch generator itself."""
    g = torch.Generator().manual_seed(0)
    for _ in range(step + 1):
        _, mask, _, _ = M.strokes_batch(g)
    return torch.nonzero((mask == 0).any(1)).flatten().tolist()


def test_padding_from_torch_empty_names_the_overflow_and_the_mask_that_kept_it(tmp_path):
    """A collate_fn that allocates the padded batch with ``torch.empty`` and writes only each
    line's points: the padded steps hold stale memory (1e30 here, a deterministic stand-in).
    The square of the standardised offset overflows there, ``-z / (2 (1 - rho^2))`` turns the
    infinity into NaN, and ``(nll * mask)`` keeps it (inf * 0). The replay names the pow on
    its line, every line with padding, overflow, and the mask's product with the fix: pad
    with 0 or keep the padded steps out of the op."""
    rows = padded_rows()
    assert rows, rows
    ev, bundle = fire("make_synthesis", "mdn_loss", tmp_path, "garbage_pad", bad=0)
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "loss", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("<loss>", "aten.pow", "+inf", rows), o
    assert o["source"] == line_of("z = z1 ** 2 + z2 ** 2 - 2 * rho * z1 * z2"), o
    assert rep["cause"] == "overflow", rep["cause"]
    mul = line_of("return (step_nll(out, target) * mask).sum() / mask.sum()")
    assert f"multiplied by a mask's 0 in aten.mul ({mul})" in rep["hint"], rep["hint"]
    assert "pad with 0" in rep["hint"], rep["hint"]


def saturated_rows(amp: bool = False) -> list[int]:
    """The lines of the first batch where ``tanh`` rounds some rho to exactly +-1 (in float32,
    or bfloat16 under ``amp``), counted on an unrecorded copy of the model (the replay's
    claim, checked independently)."""
    model = M.make_synthesis()
    M.resume_correlated(model, 20.0 if amp else 40.0)
    target, mask, chars, char_mask = M.strokes_batch(torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        rho = model(M.teacher_forced(target), chars, char_mask)[5]
    return torch.nonzero((rho.abs() == 1).flatten(1).any(1)).flatten().tolist()


def test_correlation_rounded_to_one_names_the_division_by_one_minus_rho_squared(tmp_path):
    """A checkpoint trained long on ruled, diagonal strokes: ``rho = tanh(rho_hat)`` with
    |rho_hat| > 9 rounds to 1 in float32, and ``-z / (2 (1 - rho^2))`` divides by 0 at the
    first step. The replay names that division, the lines where rho rounded (as counted on an
    unrecorded copy), precision (float64 keeps 1 - rho^2 > 0), and clamping rho as the fix."""
    rows = saturated_rows()
    assert 0 < len(rows) < M.BATCH, rows
    ev, bundle = fire("make_synthesis", "mdn_loss", tmp_path, "rho", bad=0)
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "loss", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("<loss>", "aten.div", "-inf", rows), o
    assert o["source"] == line_of("return (-z / (2 * one_m) - math.log(2 * math.pi)"), o
    assert rep["cause"] == "precision" and "tanh" in rep["hint"], rep["hint"]
    assert "\u03c1.clamp(" in rep["hint"], rep["hint"]


def test_distributions_loss_refusing_the_rounded_correlation_is_a_constraint_event(tmp_path):
    """The same checkpoint under a MixtureSameFamily of MultivariateNormals: the Cholesky
    factor's ``s2 * sqrt(1 - rho^2)`` is 0 where rho rounded to 1, and the distribution's
    check raises ValueError (the loop sees the user's own error). The recorder writes the
    bundle of that step; the replay names the loss, the lines where rho rounded (counted on
    an unrecorded copy), precision (float64 keeps the diagonal above 0) and clamping rho."""
    rows = saturated_rows()
    with pytest.raises(ValueError, match="LowerCholesky"):
        train("make_synthesis", "mdn_loss_dist", tmp_path, "rho", bad=0)
    bundle, = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["made"], o["samples"]) == (
        0, "loss", "<loss>", "0", rows), o
    assert rep["cause"] == "precision", rep["cause"]
    assert "MultivariateNormal refused its parameter scale_tril" in rep["hint"], rep["hint"]
    assert "\u03c1.clamp(" in rep["hint"], rep["hint"]


def test_correlation_rounded_to_one_by_bf16_autocast_says_the_type_and_float32(tmp_path):
    """The same head less sharpened (|rho_hat| up to ~6, where float32's tanh stays below 1)
    under bfloat16 autocast, the loss inside the autocast region as the ports write it: rho
    rounds to 1 in bfloat16. The replay names the division, the lines where bfloat16 rounded
    (counted on an unrecorded copy), precision in bfloat16, and computing in float32."""
    rows, exact = saturated_rows(amp=True), saturated_rows()
    assert 0 < len(rows) < M.BATCH and len(rows) > len(exact), (rows, exact)
    with pytest.raises(NonFiniteError) as info:
        train("make_synthesis", "mdn_loss", tmp_path, "rho", amp=True)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "loss", "nan"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("<loss>", "aten.div", "-inf", rows), o
    assert rep["cause"] == "precision" and "rounded to 1 in bfloat16" in rep["hint"], rep["hint"]
    assert "\u03c1.clamp(" in rep["hint"] and "in float32" in rep["hint"], rep["hint"]


def test_healthy_bf16_autocast_run_raises_nothing_and_trains_the_same(tmp_path):
    """bfloat16 autocast over the model and the loss, healthy lines: no event, and the
    recorder leaves the training bit-identical."""
    recorded = train("make_synthesis", "mdn_loss", tmp_path, steps=3, amp=True)
    plain = train("make_synthesis", "mdn_loss", tmp_path, steps=3, record=False, amp=True)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_collapsed_mixture_names_the_backward_of_log_pi_and_log_softmax(tmp_path):
    """A checkpoint whose mixture collapsed onto few components: the softmax's smallest
    weights underflow to exactly 0, ``log(pi)`` is -inf there and the logsumexp keeps the loss
    finite, but its backward hands those entries a gradient of 0 and log's derivative makes
    0/0: a backward event. The replay names LogBackward0 in the loss on the logsumexp's line,
    the lines where some pi is 0 (counted on an unrecorded copy), underflow, and log_softmax
    as the fix."""
    model = M.make_synthesis()
    M.resume_collapsed(model)
    target, mask, chars, char_mask = M.strokes_batch(torch.Generator().manual_seed(0))
    pi = model(M.teacher_forced(target), chars, char_mask)[0]
    rows = torch.nonzero((pi == 0).flatten(1).any(1)).flatten().tolist()
    assert rows, rows
    ev, bundle = fire("make_synthesis", "mdn_loss", tmp_path, "collapsed", bad=0)
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"]) == (
        "backward", "<loss>", "LogBackward0", rows), o
    assert o["source"] == line_of("mix = torch.logsumexp(torch.log(pi) + log_n, -1)"), o
    assert rep["cause"] == "underflow", rep["cause"]
    assert "log_softmax instead of log(softmax)" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("make,loss", [("make_synthesis", "mdn_loss"),
                                       ("make_normalised_window", "mdn_loss_prob"),
                                       ("make_synthesis", "mdn_loss_per_line")])
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, make, loss):
    """The healthy lines (padded pen points under the mask, Graves' derivative clipping by
    hooks, the window's LSTM cell stepped in Python): no event, and bit-identical weights
    with and without the recorder."""
    recorded = train(make, loss, tmp_path, steps=3)
    plain = train(make, loss, tmp_path, steps=3, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def train_loader(out_dir, record: bool = True, accumulate: int = 2, loss: str = "mdn_loss",
                 empty: int | None = None):
    """A DataLoader over variable-length lines (pad_sequence in the collate_fn), gradient
    accumulation over ``accumulate`` micro-batches, AdamW with a StepLR. Returns the model."""
    torch.manual_seed(5)  # (the loader's shuffle)
    model = M.make_synthesis()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    loader = torch.utils.data.DataLoader(M.Lines(empty=empty), batch_size=4, shuffle=True,
                                         collate_fn=M.collate)
    crit = getattr(M, loss)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory="handwriting_synthesis_models:make_synthesis") \
        if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for i, (target, mask, chars, char_mask) in enumerate(loader):
            out = model(M.teacher_forced(target), chars, char_mask)
            (loss_fn(*out, target, mask) / accumulate).backward()
            if (i + 1) % accumulate == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
                sched.step()
    return model


def test_healthy_loader_with_accumulation_raises_nothing_and_trains_the_same(tmp_path):
    """Variable-length lines padded by the collate_fn, two micro-batches per update: no event,
    and bit-identical weights with and without the recorder."""
    recorded = train_loader(tmp_path)
    plain = train_loader(tmp_path, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_empty_line_in_the_second_micro_batch_names_that_micro_batch_and_row(tmp_path):
    """The dataset's 14th line lost its points: the collate_fn pads it to a mask of zeros in
    the second micro-batch of the first update, and the per-line mean divides 0 by 0 there.
    The recorder names that micro-batch; the replay the division, the line's row within it
    (where the shuffled loader put it, read from the loader itself) and the empty mask."""
    torch.manual_seed(5)
    M.make_synthesis()  # (the draws train_loader makes before the shuffle)
    loader = torch.utils.data.DataLoader(M.Lines(empty=13), batch_size=4, shuffle=True,
                                         collate_fn=M.collate)
    where = [(i, r) for i, (_, mask, _, _) in enumerate(loader)
             for r in torch.nonzero(mask.sum(1) == 0).flatten().tolist()]
    assert len(where) == 1 and where[0][0] % 2 == 1, where
    with pytest.raises(NonFiniteError) as info:
        train_loader(tmp_path, loss="mdn_loss_per_line", empty=13)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["micro_batch"]) == (where[0][0] // 2, "loss", 1), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["micro_batch"], o["op"], o["samples"], rep["cause"]) == (
        1, "aten.div", [where[0][1]], "invalid"), rep
    assert f"Sample(s) {where[0][1]} are empty records: loss_args[8]" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("kind,make,loss,bad", [
    ("jump", "make_synthesis", "mdn_loss_prob", 3),
    ("empty", "make_synthesis", "mdn_loss_per_line", 2),
    ("no_text", "make_normalised_window", "mdn_loss", 6)])
def test_unrecorded_planted_runs_end_with_non_finite_weights(tmp_path, kind, make, loss, bad):
    """Without the recorder the planted steps' NaN reaches the weights through Adam (the
    gradient-norm clip passes it on): the events above are the bugs, not false alarms."""
    model = train(make, loss, tmp_path, kind, bad, record=False)
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def first_empty_window(short: int) -> tuple[int, list[int]]:
    """The call of the window whose output first goes NaN, and its rows, counted by a hook on
    an unrecorded copy (the replay's claim, checked independently)."""
    model = M.make_normalised_window()
    windows: list[torch.Tensor] = []
    model.window.register_forward_hook(lambda m, i, o: windows.append(o[0].detach()))
    target, _, chars, char_mask = M.long_lines(torch.Generator().manual_seed(0), short)
    model(M.teacher_forced(target), chars, char_mask)
    k = next(i for i, w in enumerate(windows) if not torch.isfinite(w).all())
    return k, torch.nonzero(~torch.isfinite(windows[k]).all(1)).flatten().tolist()


def test_window_run_past_a_cut_transcription_names_the_call_it_underflowed(tmp_path):
    """A line of 60 pen points whose transcription was cut to one character: kappa grows by
    its exp increments past the text's end, every Gaussian of the normalised window
    underflows to 0 over the one character left, and ``phi / phi.sum()`` is 0/0 at a late
    pen point. The recorder and the replay name that call of the window (as a hook counts it
    on an unrecorded copy), the line, the division, and underflow with log space as the fix;
    dropping the line makes the step finite."""
    call, rows = first_empty_window(short=2)
    assert call > 30 and rows == [2], (call, rows)
    model = M.make_normalised_window()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    target, mask, chars, char_mask = M.long_lines(torch.Generator().manual_seed(0), 2)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.mdn_loss, out_dir=tmp_path,
                            factory="handwriting_synthesis_models:make_normalised_window") as rec:
            out = model(M.teacher_forced(target), chars, char_mask)
            rec.loss_fn(*out, target, mask).backward()
            opt.step()
    ev = info.value.event
    assert (ev["phase"], ev["module"], ev["call"], ev["samples"]) == (
        "forward", "window", call, rows), ev
    rep = nanreplay_json(info.value.bundle_path, "--try", "drop=2")
    o = rep["origin"]
    assert (o["module"], o["call"], o["op"], o["samples"], o["inputs_finite"]) == (
        "window", call, "aten.div", rows, True), o
    assert o["source"] == line_of("phi = phi / phi.sum(-1, keepdim=True)"), o
    assert rep["cause"] == "underflow" and "log space" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_end_of_stroke_probability_rounded_to_one_names_log_of_its_complement(tmp_path):
    """The end-of-stroke Bernoulli written by hand, ``(1 - pen) * log(1 - eos)`` with
    ``eos = sigmoid(e_hat)``: a checkpoint whose e_hat is past 17 at some pen points of every
    line rounds eos to 1 there, and ``log(1 - eos)`` is log 0 at the first step. The replay names that log on its line,
    precision, and ``logsigmoid(-z)`` as the fix."""
    model = M.make_synthesis()
    M.resume_sure_of_pen_lifts(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    target, mask, chars, char_mask = M.strokes_batch(torch.Generator().manual_seed(0))
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.mdn_loss, out_dir=tmp_path,
                            factory="handwriting_synthesis_models:make_synthesis") as rec:
            out = model(M.teacher_forced(target), chars, char_mask)
            rec.loss_fn(*out, target, mask).backward()
            opt.step()
    assert bool((out[6] == 1).any(1).all()), out[6]  # (some pen point of every line)
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["made"], o["samples"]) == (
        "loss", "<loss>", "aten.log", "-inf", list(range(M.BATCH))), o
    assert o["source"] == line_of("pen_ll = pen * torch.log(eos) + (1 - pen) * torch.log(1 - eos)")
    assert rep["cause"] == "precision", rep["cause"]
    assert "log(1 \u2212 sigmoid(z)) = logsigmoid(\u2212z)" in rep["hint"], rep["hint"]
