"""End to end: the losses projects write themselves are replayed, not refused, and a loss
computed outside the recorded model is named as such.

Every test trains ``user_losses.Tagger`` with a real loop and SGD until a planted bug fires at
step K, then runs ``nanreplay BUNDLE --json`` through the command line and checks the report:
phase, step, module, op, samples, cause, notes, reproduced. Source lines are found by reading
``user_losses.py`` (the line marked ``# BUG ...``), not by asking the tool.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import user_losses as UL
from bundles import invoke_cli, replay_report

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle

HERE = Path(__file__).parent
K = 3  # the step the planted bugs fire at


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def train(out_dir: Path, step_loss, *, loss_fn=None, spoil=None, steps: int = 6):
    """Train the tagger; ``step_loss(rec, out, y, step)`` computes the step's loss the way the
    test's training code does; ``spoil(step, x, y)`` plants the bug. Returns the error."""
    model = UL.make_tagger()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                            factory="user_losses:make_tagger") as rec:
            for step in range(steps):
                x, y = UL.batch(step)
                if spoil is not None:
                    spoil(step, x, y)
                opt.zero_grad()
                out = model(x)
                loss = step_loss(rec, out, y, step)
                loss.backward()
                opt.step()
    err = info.value
    assert err.bundle_path is not None and err.event["step"] == K, err
    return err


def bug_line(marker: str) -> str:
    """``user_losses.py:<n>`` of the line holding ``# BUG <marker>``, read from the file."""
    lines = (HERE / "user_losses.py").read_text().splitlines()
    hits = [i + 1 for i, text in enumerate(lines) if f"# BUG {marker}" in text]
    assert len(hits) == 1, marker
    return f"user_losses.py:{hits[0]}"


def origin(rep: dict, *keys: str) -> tuple:
    return tuple(rep["origin"][k] for k in keys)


def notes_about(rep: dict, *words: str) -> list[str]:
    return [p for p in rep["problems"] if any(w in p for w in words)]


# ---------------------------------------------------------------------------------------------
# 1. user-defined losses


def test_ctc_subclass_taking_a_target_tuple(tmp_path):
    """A ``CTCLoss`` subclass whose forward unpacks (targets, input lengths, target lengths):
    sample 4's target is longer than its input, an alignment that does not exist (inf)."""
    crit = UL.TupleCTC(blank=0, zero_infinity=False)
    S = UL.T + 1

    def step_loss(rec, out, y, step):
        targets = torch.cat([y[:, :3], torch.ones(UL.B, S - 3, dtype=torch.long)], 1)
        tgt_lens = torch.full((UL.B,), 3, dtype=torch.long)
        if step == K:
            tgt_lens[4] = S  # BUG: 7 labels cannot align to 6 frames
        return crit(out, (targets, torch.full((UL.B,), UL.T, dtype=torch.long), tgt_lens))

    err = train(tmp_path, step_loss, loss_fn=crit)
    assert (err.event["phase"], err.event["module"]) == ("loss", "<loss>")
    meta, _ = read_bundle(err.bundle_path)
    assert meta["loss"]["tree"]["import"] == "user_losses:TupleCTC"
    assert meta["loss"]["tree"]["config"]["blank"] == 0
    rep, code = replay_report(err.bundle_path)
    assert rep["event"]["step"] == K
    assert origin(rep, "phase", "module", "op", "made", "samples") == (
        "loss", "<loss>", "aten._ctc_loss", "+inf", [4])
    assert rep["origin"]["source"] == bug_line("ctc")
    assert (rep["reproduced"], rep["cause"], code) == (True, "invalid", 0)
    assert rep["problems"] == []
    assert rep["fidelity"]["matches"] is True


def test_focal_loss_whose_constructor_needs_arguments(tmp_path):
    """A hand-written focal loss (``gamma`` and class weights required by ``__init__``) trained
    on pseudo-labels taken from the model's own prediction: sample 2 is scaled up, its
    prediction is certain (pt == 1 exactly) and ``(1 - pt) ** 0.5`` has an infinite
    derivative there: a backward origin inside the loss."""
    crit = UL.FocalLoss(gamma=0.5, alpha=torch.linspace(0.5, 1.5, UL.C))

    def spoil(step, x, y):
        if step == K:
            x[2] *= 1000.0

    def step_loss(rec, out, y, step):
        y = y.clone()
        y[2] = out[2].argmax(-1)  # pseudo-labels for the unlabelled sample
        return crit(out, y)

    err = train(tmp_path, step_loss, loss_fn=crit, spoil=spoil)
    assert err.event["phase"] == "backward"
    rep, code = replay_report(err.bundle_path)
    assert origin(rep, "phase", "module", "op") == ("backward", "<loss>", "PowBackward0")
    assert rep["origin"]["source"] == bug_line("focal")
    assert "enc.weight" in rep["origin"]["params"]
    assert (rep["reproduced"], rep["cause"], code) == (True, "invalid", 0)
    assert rep["problems"] == []


def test_cross_entropy_wrapper_over_an_all_padding_batch(tmp_path):
    """A wrapper that reshapes for ``CrossEntropyLoss`` (a submodule with class weights and
    ``ignore_index``); at step K every label is padding: the weighted mean over no token is
    0/0, with zero gradients, so only the loss shows it."""
    crit = UL.FlatCE(UL.C, weight=torch.linspace(1.0, 2.0, UL.C))

    def spoil(step, x, y):
        if step == K:
            y.fill_(UL.PAD)

    err = train(tmp_path, lambda rec, out, y, step: crit(out, y), loss_fn=crit, spoil=spoil)
    assert (err.event["phase"], err.event["kind"]) == ("loss", "nan")
    meta, tensors = read_bundle(err.bundle_path)
    child = meta["loss"]["tree"]["children"]["ce"]
    assert (child["import"], child["config"]["ignore_index"]) == (
        "torch.nn.modules.loss:CrossEntropyLoss", UL.PAD)
    assert torch.equal(tensors[child["buffers"]["weight"]], torch.linspace(1.0, 2.0, UL.C))
    rep, code = replay_report(err.bundle_path)
    assert origin(rep, "phase", "module", "op", "made") == (
        "loss", "<loss>", "aten.nll_loss_forward", "nan")
    assert rep["origin"]["source"] == bug_line("flat")
    # (no row holds a target: every row, "all N rows", as with gradient accumulation)
    assert rep["origin"]["all_samples"] is True
    assert (rep["reproduced"], rep["cause"], code) == (True, "invalid", 0)
    assert rep["problems"] == []


@pytest.mark.parametrize("name, bug", [("lm_loss", "lm"), ("lm_loss_counted", "counted")])
def test_plain_function_loss_names_the_op_and_the_rows(tmp_path, name, bug):
    """``def lm_loss(out, labels)`` given as ``loss_fn`` and called as ``rec.loss_fn``: sample
    5 is all padding, its per-sequence mean 0/0; the rows are those of the op's output. The
    hint says 0/0 also when the token count is an integer tensor (``mask.sum(1)`` of a bool
    mask), which the op's floating inputs leave out."""

    def spoil(step, x, y):
        if step == K:
            y[5] = UL.PAD

    err = train(tmp_path, lambda rec, out, y, step: rec.loss_fn(out, y),
                loss_fn=getattr(UL, name), spoil=spoil)
    meta, _ = read_bundle(err.bundle_path)
    assert meta["loss"]["import"] == f"user_losses:{name}"
    rep, code = replay_report(err.bundle_path)
    assert origin(rep, "phase", "module", "op", "made", "samples") == (
        "loss", "<loss>", "aten.div", "nan", [5])
    assert rep["origin"]["source"] == bug_line(bug)
    assert (rep["reproduced"], rep["cause"], code) == (True, "invalid", 0)
    assert "aten.div of 0 by 0 (0/0)" in rep["hint"], rep["hint"]
    assert rep["problems"] == []


def test_a_lambda_loss_gets_one_true_note(tmp_path):
    """A lambda cannot be imported: one note says so, where it is defined and how to make it
    replayable; the replay still says where the values entered (the recorded gradient of the
    model output: a masked mean over an all-padding batch) and no note claims the loss was not
    given. The loss itself was never re-run, so the event is said not re-run (exit 1), not
    reproduced."""

    def spoil(step, x, y):
        if step == K:
            y.fill_(UL.PAD)

    crit = lambda out, y: (F.cross_entropy(  # noqa: E731  (the lambda loss)
        out.flatten(0, 1), y.flatten(), reduction="none") * (y != UL.PAD).flatten()).sum() / (
        y != UL.PAD).sum()

    err = train(tmp_path, lambda rec, out, y, step: rec.loss_fn(out, y), loss_fn=crit,
                spoil=spoil)
    assert err.event["phase"] == "loss"
    rep, code = replay_report(err.bundle_path)
    lines = Path(__file__).read_text().splitlines()
    at = next(i + 1 for i, t in enumerate(lines) if "(the lambda loss)" in t)
    [note] = rep["problems"]
    assert note.startswith("the loss function test_user_losses.test_a_lambda_loss_gets_one_"
                           f"true_note.<locals>.<lambda> is a lambda "
                           f"(test_user_losses.py:{at}), which no import path leads to, so the "
                           "loss was not re-run; define it at module level"), note
    assert "{'model': ..., 'loss_fn': ...}" in note
    assert not notes_about(rep, "record_loss", "outside a loss function")
    assert "loss_fn=" not in (rep["hint"] or "") and "as the note says" in rep["hint"]
    assert origin(rep, "phase", "module", "samples") == ("loss", "<loss>", list(range(UL.B)))
    assert rep["origin"]["detail"].startswith("the gradient entering the model's output")
    assert (rep["reproduced"], rep["cause"], code) == (False, None, 1)
    assert "loss cannot be rebuilt" in rep["not_rerun"]


def make_loss(ignore_index: int):
    def padded_ce(out, y):  # (the closure loss)
        return F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=ignore_index)

    return padded_ce


def test_a_closure_loss_with_finite_gradients_gets_one_true_note(tmp_path):
    """A loss made by a function (a closure over its settings): cross entropy over an
    all-padding batch is 0/0 with zero gradients, so nothing entered the model; the report says
    the loss could not be rebuilt, once, and never that it was not given."""

    def spoil(step, x, y):
        if step == K:
            y.fill_(UL.PAD)

    err = train(tmp_path, lambda rec, out, y, step: rec.loss_fn(out, y),
                loss_fn=make_loss(UL.PAD), spoil=spoil)
    rep, code = replay_report(err.bundle_path)
    lines = Path(__file__).read_text().splitlines()
    at = next(i + 1 for i, t in enumerate(lines) if "(the closure loss)" in t)
    [note] = rep["problems"]
    assert note.startswith("the loss function test_user_losses.make_loss.<locals>.padded_ce is "
                           f"defined inside another function (test_user_losses.py:{at}), which "
                           "no import path leads to, so the loss was not re-run"), note
    assert origin(rep, "phase", "module", "op", "detail") == ("loss", "<loss>", None, None)
    assert (rep["reproduced"], rep["cause"], code) == (False, None, 1)
    assert "as the note says" in rep["hint"] and "loss_fn=" not in rep["hint"]
    # the model re-ran as recorded, its loss could not: not "NOT reproduced" (nondeterminism)
    assert invoke_cli(err.bundle_path).stdout.splitlines()[0] == (
        f"nanreplay: step {K}, loss event — not re-run (its loss cannot be rebuilt from the "
        "bundle; see the note)")


def test_one_loss_over_two_forwards_names_the_loss_op_and_re_runs_both_views(tmp_path):
    """A contrastive loss over two views, one forward each (two micro-batches), whose
    temperature a schedule brings to 0: the loss event is in micro-batch 1, whose loss takes
    micro-batch 0's output too. The bundle links that argument to micro-batch 0's output (the
    replay feeds it the re-computed view, not a recorded copy), and the report names the
    division by the Python number 0 in the loss. Before: the replay crashed (TypeError)."""
    model, crit = UL.make_tagger(), UL.TwoViewContrastive()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="user_losses:make_tagger"):
            for step in range(6):
                x, _ = UL.batch(step)
                crit.temperature = 0.5 * (1 - step / K)  # 0 at step K
                opt.zero_grad()
                loss = crit(model(x + 0.1), model(x - 0.1))
                loss.backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["micro_batch"]) == (K, "loss", 1)
    meta, _ = read_bundle(err.bundle_path)
    assert meta["micro_batches"][1]["loss_inputs"]["$list"][0]["$list"] == [
        {"$out": 0, "mb": 0}, {"$out": 0}]
    rep, code = replay_report(err.bundle_path)
    assert origin(rep, "phase", "module", "op", "micro_batch") == (
        "loss", "<loss>", "aten.div", 1)
    assert rep["origin"]["source"].startswith(bug_line("temperature")), rep["origin"]
    assert (rep["reproduced"], rep["cause"], code) == (True, "invalid", 0)
    assert "aten.div by the number 0 (x/0, a pole)" in rep["hint"], rep["hint"]


def test_triplet_loss_over_chunks_of_one_forward(tmp_path):
    """Anchors, positives and negatives through one forward, the loss given its three chunks
    (views of the output; the anchors' starts where the output does). The replay took the
    anchors' chunk for a reshape of the whole output and fed the loss all 24 rows: the re-run
    failed ("size of tensor a (24) must match ... (8)"). At step K positive 2 is a copy of
    its anchor: sqrt at 0 in backward."""
    model, crit = UL.make_tagger(), UL.TripletLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="user_losses:make_tagger"):
            for step in range(6):
                xa, xn = UL.batch(step)[0], UL.batch(100 + step)[0]
                xp = xa + 0.1 * UL.batch(200 + step)[0]
                if step == K:
                    xp[2] = xa[2]
                opt.zero_grad()
                a, p, n = model(torch.cat([xa, xp, xn])).chunk(3)
                crit(a, p, n).backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (K, "backward")
    rep, code = replay_report(err.bundle_path)
    assert origin(rep, "phase", "module", "op") == ("backward", "<loss>", "SqrtBackward0")
    assert rep["origin"]["source"] == bug_line("triplet")
    assert (rep["reproduced"], rep["cause"], code) == (True, "invalid", 0)
    assert rep["problems"] == []


# ---------------------------------------------------------------------------------------------
# 2. a loss computed outside the recorded model


def masked_mean_loop(rec, out, y, step, *, hand_over: bool):
    """The loop's own inline loss: the mean token loss over the unmasked tokens; the mask of
    step K is all zero (every token masked), so it is 0/0 and every gradient NaN."""
    mask = torch.ones_like(y, dtype=torch.float32)
    if step == K:
        mask.zero_()
    tok = F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none").view_as(y)
    loss = (tok * mask).sum() / mask.sum()
    if hand_over:
        rec.record_loss(loss)
    return loss


@pytest.mark.parametrize("hand_over", [False, True], ids=["unseen", "record_loss"])
def test_masked_mean_outside_the_model_is_named_as_the_loss(tmp_path, hand_over):
    """Not 'not reproduced': the model re-runs finite and as recorded, the recorded gradient
    of its output is NaN at every position, and feeding it back gives the NaN gradients."""
    err = train(tmp_path, lambda rec, out, y, step: masked_mean_loop(rec, out, y, step,
                                                                     hand_over=hand_over))
    assert err.event["phase"] == ("loss" if hand_over else "backward")
    rep, code = replay_report(err.bundle_path)
    assert rep["event"]["step"] == K
    assert origin(rep, "phase", "module", "op", "made", "samples") == (
        "loss", "<loss>", None, "nan", list(range(UL.B)))
    assert rep["origin"]["detail"] == ("the gradient entering the model's output was "
                                       "non-finite; the model's backward made none of its own")
    assert rep["origin"]["positions"] == {"non_finite": UL.B * UL.T * UL.C,
                                          "of": UL.B * UL.T * UL.C}
    assert set(rep["origin"]["params"]) == {"enc.weight", "enc.bias", "head.weight",
                                            "head.bias"}
    assert (rep["reproduced"], rep["cause"], code) == (True, None, 0)
    assert rep["fidelity"]["matches"] is True and rep["fidelity"]["calls"] > 0
    assert "loss_fn=" in rep["hint"] and "record_loss" in rep["hint"]
    assert "device" not in rep["hint"] and "hardware" not in rep["hint"]
    if hand_over:
        [note] = rep["problems"]
        assert note.startswith("the loss given to record_loss was computed outside")
    else:
        assert rep["problems"] == []
    text = invoke_cli(err.bundle_path)
    assert text.exit_code == 0
    assert text.stdout.splitlines()[1:3] == [
        "  origin     loss: the gradient entering the model's output was non-finite; the model's "
        "backward made none of its own",
        f"  entered    nan in {UL.B * UL.T * UL.C} of {UL.B * UL.T * UL.C} elements of the "
        "recorded grad of the model output"]


def test_loss_terms_outside_loss_fn(tmp_path):
    """loss_fn is given, but the loop adds a term of its own (a masked mean over an all-zero
    mask): the re-run loss_fn is finite, the recorded output gradient is not."""
    crit = torch.nn.CrossEntropyLoss()

    def step_loss(rec, out, y, step):
        main = crit(out.flatten(0, 1), y.flatten())
        return main + 0.1 * masked_mean_loop(rec, out, y, step, hand_over=False)

    err = train(tmp_path, step_loss, loss_fn=crit)
    assert err.event["phase"] == "backward"
    rep, code = replay_report(err.bundle_path)
    assert origin(rep, "phase", "module", "samples") == ("loss", "<loss>", list(range(UL.B)))
    assert (rep["reproduced"], rep["cause"], code) == (True, None, 0)
    [note] = rep["problems"]
    assert "loop's loss holds terms computed outside it" in note
    assert "whole loss inside loss_fn" in rep["hint"]


def test_not_reproduced_never_suggests_hardware_when_reruns_agree(tmp_path):
    """A NaN made by state the bundle does not hold (a process-wide counter): the re-runs
    agree with each other, so the hint speaks of that, not of the device."""
    import replay_models as R

    R.CALLS.update(n=0, fire_at=K + 1, every=0)
    model = R.make_counted_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = torch.nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="replay_models:make_counted_net"):
            for step in range(6):
                x, y = R.batch(step)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    rep, code = replay_report(info.value.bundle_path)
    assert (rep["reproduced"], rep["cause"], code) == (False, "not_reproduced", 1)
    assert "agree with each other" in rep["hint"]
    assert "device" not in rep["hint"] and "hardware" not in rep["hint"]


# ---------------------------------------------------------------------------------------------
# bundles written before the loss description


def test_a_bundle_without_the_loss_description_is_still_replayed(tmp_path):
    """A bundle of an earlier recorder has only the flat loss fields: a torch.nn built-in is
    rebuilt from them as before (here a weighted CrossEntropyLoss over an all-padding batch)."""
    from recorder.bundle import write_bundle

    crit = torch.nn.CrossEntropyLoss(weight=torch.linspace(1.0, 2.0, UL.C), ignore_index=UL.PAD)

    def spoil(step, x, y):
        if step == K:
            y.fill_(UL.PAD)

    err = train(tmp_path, lambda rec, out, y, step: crit(out.flatten(0, 1), y.flatten()),
                loss_fn=crit, spoil=spoil)
    meta, tensors = read_bundle(err.bundle_path)
    del meta["loss"]["tree"], meta["factory_kwargs"]
    meta["recorder"].pop("integration")
    (tmp_path / "old").mkdir()
    old = write_bundle(tmp_path / "old", "old", meta, tensors)
    rep, code = replay_report(old)
    assert origin(rep, "phase", "module", "op", "made") == (
        "loss", "<loss>", "aten.nll_loss_forward", "nan")
    assert (rep["reproduced"], rep["cause"], code) == (True, "invalid", 0)
    assert rep["problems"] == []


def test_loss_code_is_imported_only_under_the_trust_rule(tmp_path, monkeypatch):
    """A loss class from a module neither under the current directory nor installed is not
    imported by the replay (its import leaves a marker file), and a recorded path that leads
    out of a trusted module (``user_losses:torch.os.system``) is not called: one note each."""
    import sys

    from recorder.bundle import write_bundle

    code, marker = tmp_path / "elsewhere", tmp_path / "imported"
    code.mkdir()
    (code / "far_losses.py").write_text(
        "import pathlib\nimport torch\n"
        f"pathlib.Path({str(marker)!r}).touch()\n"
        "class FarCE(torch.nn.CrossEntropyLoss):\n    pass\n")
    monkeypatch.syspath_prepend(str(code))
    import far_losses

    crit = far_losses.FarCE(ignore_index=UL.PAD)

    def spoil(step, x, y):
        if step == K:
            y.fill_(UL.PAD)

    err = train(tmp_path / "b", lambda rec, out, y, step: crit(out.flatten(0, 1), y.flatten()),
                loss_fn=crit, spoil=spoil)
    monkeypatch.delitem(sys.modules, "far_losses")
    marker.unlink()
    rep, code_ = replay_report(err.bundle_path)
    assert not marker.exists() and "far_losses" not in sys.modules
    [note] = rep["problems"]
    assert note.startswith("the loss class far_losses.FarCE is in 'far_losses', which is neither "
                           f"under the current directory ({HERE}) nor an installed package, so "
                           "nanreplay does not import it"), note
    assert (rep["origin"]["phase"], rep["reproduced"], rep["cause"], code_) == (
        "loss", False, None, 1)
    # a recorded path leading out of a trusted module
    meta, tensors = read_bundle(err.bundle_path)
    meta["loss"] = {"kind": "function", "name": "user_losses.torch.os.system",
                    "import": "user_losses:torch.os.system"}
    (tmp_path / "forged").mkdir()
    forged = write_bundle(tmp_path / "forged", "forged", meta, tensors)
    rep, _ = replay_report(forged)
    [note] = rep["problems"]
    assert note.startswith("the recorded path user_losses:torch.os.system of the loss "
                           "function user_losses.torch.os.system leads to posix.system, defined "
                           "outside the current directory and installed packages; nanreplay "
                           "does not call it"), note


def test_an_outside_loss_does_not_hide_the_models_own_backward_bug(tmp_path):
    """The masked mean over an all-zero mask makes the gradient entering the model NaN, and the
    model's own backward makes NaN too (sqrt at 0 for an all-zero row): fed the entering
    gradient with its NaN entries set to 0, the model's backward still makes one, so the report
    names that node, with a note about the entering gradient."""
    import inspect

    import replay_models as R

    model = R.make_length_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path, factory="replay_models:make_length_net"):
            for step in range(6):
                x, y = R.batch(step)
                mask = torch.ones(R.BATCH)
                if step == K:
                    x[6] = 0.0
                    mask.zero_()
                opt.zero_grad()
                tok = F.cross_entropy(model(x), y, reduction="none")
                ((tok * mask).sum() / mask.sum()).backward()
                opt.step()
    assert info.value.event["phase"] == "backward"
    rep, code = replay_report(info.value.bundle_path)
    assert origin(rep, "phase", "module", "op") == ("backward", "feat", "SqrtBackward0")
    lines, start = inspect.getsourcelines(R.WithLength)
    line = start + next(i for i, t in enumerate(lines) if "torch.sqrt" in t)
    assert rep["origin"]["source"] == f"replay_models.py:{line}"
    assert (rep["reproduced"], rep["cause"], code) == (True, "invalid", 0)
    [note] = rep["problems"]
    assert note.startswith("the gradient entering the model's output was non-finite too")


def test_a_partial_of_a_torch_loss_is_rebuilt_with_its_arguments(tmp_path):
    """``loss_fn=functools.partial(F.cross_entropy, ignore_index=PAD)`` over (B*T, C): the
    bundle holds the function's path and its JSON arguments; an all-padding batch is 0/0."""
    import functools

    crit = functools.partial(F.cross_entropy, ignore_index=UL.PAD)

    def spoil(step, x, y):
        if step == K:
            y.fill_(UL.PAD)

    err = train(tmp_path, lambda rec, out, y, step: rec.loss_fn(out.flatten(0, 1), y.flatten()),
                loss_fn=crit, spoil=spoil)
    meta, _ = read_bundle(err.bundle_path)
    assert (meta["loss"]["import"], meta["loss"]["partial"]) == (
        "torch.nn.functional:cross_entropy", {"args": [], "keywords": {"ignore_index": UL.PAD}})
    rep, code = replay_report(err.bundle_path)
    assert origin(rep, "phase", "module", "op", "made") == (
        "loss", "<loss>", "aten.nll_loss_forward", "nan")
    assert (rep["reproduced"], rep["cause"], code) == (True, "invalid", 0)
    assert rep["problems"] == []


class _Vocab:
    """Not a JSON value, a tensor, a module or a function, and holding a set, which no JSON
    value is: the bundle cannot store it (a plain object of JSON values it can)."""

    pad = UL.PAD

    def __init__(self):
        self.specials = {"<pad>", "<unk>"}


class VocabCE(torch.nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab

    def forward(self, out, y):
        return F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=self.vocab.pad)


def test_a_loss_holding_an_object_the_bundle_cannot_store_is_said_not_rebuilt(tmp_path):
    def spoil(step, x, y):
        if step == K:
            y.fill_(UL.PAD)

    crit = VocabCE(_Vocab())
    err = train(tmp_path, lambda rec, out, y, step: crit(out, y), loss_fn=crit, spoil=spoil)
    meta, _ = read_bundle(err.bundle_path)
    assert meta["loss"]["tree"]["unrecorded"] == ["vocab (_Vocab)"]
    rep, code = replay_report(err.bundle_path)
    assert rep["problems"] == [
        "the loss test_user_losses.VocabCE holds attribute(s) the bundle cannot store (vocab "
        "(_Vocab): not JSON values, tensors, modules or importable functions), so it was not "
        "rebuilt; return it from the factory as {'model': ..., 'loss_fn': ...}"]
    assert (rep["origin"]["phase"], rep["reproduced"], rep["cause"], code) == (
        "loss", False, None, 1)


def test_an_inline_loss_of_a_later_micro_batch_is_named_with_it(tmp_path):
    """Gradient accumulation over two micro-batches with the loop's own masked mean: only the
    second one's mask is all zero at step K, so its output gradient alone is NaN. The report
    names that micro-batch (a GAN's discriminator, called on real and fake data in one step, is
    the same shape), in JSON and in the text's 'entered' line."""
    model = UL.make_tagger()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path, factory="user_losses:make_tagger"):
            for step in range(6):
                opt.zero_grad()
                for micro in range(2):
                    x, y = UL.batch(2 * step + micro)
                    out = model(x)
                    mask = torch.zeros_like(y, dtype=torch.float32) if (step, micro) == (K, 1) \
                        else torch.ones_like(y, dtype=torch.float32)
                    tok = F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none")
                    ((tok.view_as(y) * mask).sum() / mask.sum() / 2).backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (K, "backward")
    rep, code = replay_report(err.bundle_path)
    assert origin(rep, "phase", "module", "micro_batch", "made", "samples") == (
        "loss", "<loss>", 1, "nan", list(range(UL.B)))
    assert (rep["reproduced"], rep["cause"], code) == (True, None, 0)
    text = invoke_cli(err.bundle_path).stdout.splitlines()
    n = UL.B * UL.T * UL.C
    assert text[2] == (f"  entered    nan in {n} of {n} elements of the recorded grad of the "
                       "model output, micro-batch 1"), text


def train_rater(out_dir: Path, *, hand_over: bool, given: bool | None = None):
    """The rater with the loop's own log-space loss (or, ``hand_over``, the same function as
    ``rec.loss_fn``); at step K items 1 and 4 are marked absent, so their ratings are 0.
    ``given``: the function is given as ``loss_fn`` (default: when ``hand_over``)."""
    model = UL.make_rater()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=out_dir, factory="user_losses:make_rater",
                            loss_fn=UL.log_rating_loss if (hand_over if given is None
                                                            else given) else None) as rec:
            for step in range(6):
                x, _ = UL.batch(step)
                x, rating = x[:, 0], x[:, 1, 0].abs() + 1
                present = torch.ones(UL.B)
                if step == K:
                    present[[1, 4]] = 0
                opt.zero_grad()
                pred = model(x, present)
                loss = (rec.loss_fn if hand_over else UL.log_rating_loss)(pred, rating)
                loss.backward()
                opt.step()
    return info.value


def test_an_unseen_loss_whose_gradient_a_relu_drops_is_still_an_event(tmp_path):
    """log(0) in a loss the recorder cannot see: the loss is +inf and its gradient entering the
    model is -inf at the two zero ratings, but the final ReLU drops exactly those entries, so
    every parameter's gradient is finite and training would go on with an infinite loss. The
    gradient entering the output is checked like the parameters': a backward event at step K
    naming those rows; the replay says where the values entered and that training went on."""
    err = train_rater(tmp_path, hand_over=False)
    assert (err.event["step"], err.event["phase"], err.event["kind"]) == (K, "backward", "-inf")
    assert (err.event["params"], err.event["samples"]) == ([], [1, 4])
    assert err.event["tensor"] == "grad of the model output"
    assert "Tensor grad of the model output, samples [1, 4]" in str(err)
    rep, code = replay_report(err.bundle_path)
    assert origin(rep, "phase", "module", "made", "samples", "params") == (
        "loss", "<loss>", "-inf", [1, 4], [])
    assert rep["origin"]["positions"] == {"non_finite": 2, "of": UL.B}
    assert (rep["reproduced"], rep["cause"], code) == (True, None, 0)
    assert rep["problems"] == [
        "every parameter's gradient stayed finite: the model's backward drops those entries "
        "(a ReLU at 0, a mask), so the update would have gone ahead while the loss was "
        "non-finite"]
    assert "loss_fn=" in rep["hint"]


def test_a_loss_fn_given_but_called_directly_is_not_said_to_have_re_run_finite(tmp_path):
    """The function given as ``loss_fn`` but called directly, not as ``rec.loss_fn``: the
    recorder never saw it (a backward event from the gradient entering the output), and the
    replay had no loss to re-run. The report said "the loss_fn the replay re-ran is finite"
    and blamed terms outside it, clearing the loss that holds the bug; it must say the
    loss_fn was not called and how to call it."""
    err = train_rater(tmp_path, hand_over=False, given=True)
    assert (err.event["step"], err.event["phase"]) == (K, "backward")
    rep, code = replay_report(err.bundle_path)
    assert origin(rep, "phase", "module", "samples") == ("loss", "<loss>", [1, 4])
    assert not any("re-ran is finite" in p for p in rep["problems"]), rep["problems"]
    assert any("user_losses.log_rating_loss) was not called in this step" in p
               and "rec.loss_fn(...)" in p for p in rep["problems"]), rep["problems"]
    assert "rec.loss_fn(out, target)" in rep["hint"] and "re-ran finite" not in rep["hint"]


def test_the_same_loss_given_as_loss_fn_names_the_log(tmp_path):
    """The same bug with the function given as ``loss_fn``: the loss itself is checked (a loss
    event), and the replay re-runs it: aten.log on rows 1 and 4, a pole (invalid)."""
    err = train_rater(tmp_path, hand_over=True)
    assert (err.event["step"], err.event["phase"]) == (K, "loss")
    rep, code = replay_report(err.bundle_path)
    assert origin(rep, "phase", "module", "op", "samples", "source") == (
        "loss", "<loss>", "aten.log", [1, 4], bug_line("log0"))
    assert (rep["reproduced"], rep["cause"], code) == (True, "invalid", 0)


def test_a_loss_that_sums_in_an_allowed_minus_inf_names_the_reduction_and_the_rows(tmp_path):
    """Logits masked with -inf on purpose (``allow_inf=[""]`` lets the output hold them) and a
    hand-written label smoothing that gives the masked classes weight: the loss is +inf at
    step K, when sample 2 first has a mask. No op made a non-finite value from finite inputs,
    so the report had no op, no samples and said the loss was non-finite "from finite model
    outputs"; it must name the sum that folded the -inf in, its row, and what to do."""
    model = UL.make_masked_tagger()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=UL.SmoothedCE(), out_dir=tmp_path,
                            factory="user_losses:make_masked_tagger", allow_inf=[""]) as rec:
            for step in range(6):
                x, y = UL.batch(step)
                allowed = torch.ones(UL.B, UL.C, dtype=torch.bool)
                if step == K:
                    allowed[2] = F.one_hot(y[2], UL.C).sum(0) > 0  # only its own labels
                opt.zero_grad()
                rec.loss_fn(model(x, allowed), y).backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (K, "loss")
    rep, code = replay_report(err.bundle_path)
    assert origin(rep, "phase", "module", "op", "made", "samples", "source") == (
        "loss", "<loss>", "aten.sum", "+inf", [2], bug_line("smooth"))
    assert (rep["reproduced"], rep["cause"], code) == (True, "invalid", 0)
    assert "folded an infinity" in rep["hint"] and "zero weight" in rep["hint"], rep["hint"]
    assert "finite model outputs" not in rep["hint"], rep["hint"]


def test_a_mask_reaching_the_output_gets_the_mask_hint_not_the_domain_advice(tmp_path):
    """The same masked logits recorded without ``allow_inf``: by default a -inf in the model
    output is an event (step K, where sample 2 first has a mask). No op overflowed or left its
    domain, yet the hint said "invalid math that exact arithmetic makes too: guard the op's
    domain (clamp before log/sqrt, add eps ...)"; it must say the fill was a mask and how to
    allow it, and the note must name the root's own pattern ''."""
    model = UL.make_masked_tagger()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = torch.nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="user_losses:make_masked_tagger"):
            for step in range(6):
                x, y = UL.batch(step)
                allowed = torch.ones(UL.B, UL.C, dtype=torch.bool)
                if step == K:
                    allowed[2] = F.one_hot(y[2], UL.C).sum(0) > 0
                opt.zero_grad()
                crit(model(x, allowed).transpose(1, 2), y).backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (K, "forward", "")
    rep, code = replay_report(err.bundle_path)
    assert origin(rep, "op", "made", "samples") == ("aten.masked_fill", "-inf", [2])
    assert rep["cause"] == "invalid" and "filled a literal -Inf on purpose" in rep["hint"]
    assert "allow_inf" in rep["hint"] and "clamp before log" not in rep["hint"], rep["hint"]
    assert notes_about(rep, "allow_inf=['']"), rep["problems"]


def test_a_loss_fn_called_directly_is_named_when_the_model_backward_overflows_too(tmp_path):
    """The loss function given as ``loss_fn`` but called directly; at step K one row's
    residual (1e13) makes the gradient entering the output +inf and another's (1e10) makes
    the weight's gradient overflow in the model's own backward. The report names that
    backward origin, and must also say the loss_fn was not called (it only said the loss
    made the entering gradient, though nothing had re-run it)."""
    model = UL.make_linear_regressor()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=UL.quartic_loss, out_dir=tmp_path,
                            factory="user_losses:make_linear_regressor"):
            for step in range(6):
                x = UL.batch(step)[0][:, 0]
                if step == K:
                    x[2], x[5] = 1e13, 1e10
                opt.zero_grad()
                UL.quartic_loss(model(x), x.sum(1) * 0).backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["phase"]) == (K, "backward")
    rep, code = replay_report(info.value.bundle_path)
    assert rep["origin"]["phase"] == "backward", rep["origin"]
    assert notes_about(rep, "the gradient entering the model's output was non-finite too")
    assert notes_about(rep, "user_losses.quartic_loss) was not called in this step"), \
        rep["problems"]


def test_the_error_message_says_a_loss_fn_function_was_not_called_through_the_recorder(
        tmp_path):
    """What the user reads first, the NonFiniteError message, says that the function given as
    loss_fn was called directly, so it was neither checked nor recorded."""
    err = train_rater(tmp_path, hand_over=False, given=True)
    assert "was not called through rec.loss_fn in this step" in str(err), str(err)
    assert "rec.loss_fn" not in str(train_rater(tmp_path / "b", hand_over=True))


def _ignored_ce(out, y):
    return F.cross_entropy(out, y, ignore_index=-1)


def _train_ignored(out_dir: Path, through_recorder: bool) -> None:
    """A linear classifier whose step-2 batch has every target ``ignore_index``: the mean
    cross-entropy is 0/0 = NaN with zero gradients, so nothing else ever turns non-finite."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with FlightRecorder(model, opt, loss_fn=_ignored_ce, out_dir=out_dir) as rec:
        for step in range(4):
            x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
            if step == 2:
                y[:] = -1
            opt.zero_grad()
            loss = (rec.loss_fn if through_recorder else _ignored_ce)(model(x), y)
            loss.backward()
            opt.step()


def test_a_loss_function_called_directly_is_said_once_at_the_first_step(tmp_path, caplog):
    """A plain function given as ``loss_fn`` but called directly cannot be seen: its 0/0 loss
    with zero gradients trained on with no word. The first training step's close says so once,
    naming the function and the step; called through ``rec.loss_fn`` the same NaN is a loss
    event at step 2, and nothing is said."""
    with caplog.at_level("WARNING", logger="nanreplay"):
        _train_ignored(tmp_path / "direct", through_recorder=False)
    said = [r.getMessage() for r in caplog.records if "not called through" in r.getMessage()]
    assert len(said) == 1, said
    assert "(_ignored_ce)" in said[0] and "in step 0" in said[0] and "rec.loss_fn(...)" in said[0]
    assert not list((tmp_path / "direct").glob("*.nan"))  # (no event: the case it warns of)
    caplog.clear()
    with caplog.at_level("WARNING", logger="nanreplay"):
        with pytest.raises(NonFiniteError) as info:
            _train_ignored(tmp_path / "through", through_recorder=True)
    assert (info.value.event["step"], info.value.event["phase"]) == (2, "loss")
    assert not any("not called through" in r.getMessage() for r in caplog.records)


def _train_beside_module(out_dir: Path, loop_loss: str) -> None:
    """As :func:`_train_ignored`, with ``nn.CrossEntropyLoss(ignore_index=-1)`` given as
    ``loss_fn``; the loop computes its loss with ``F.cross_entropy`` (``"inline"``), with a
    second instance of the class (``"other"``), or with the module given (``"given"``), which
    it also calls once on a held-out batch before training (a baseline validation loss)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = torch.nn.CrossEntropyLoss(ignore_index=-1)
    other = torch.nn.CrossEntropyLoss(ignore_index=-1)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir):
        if loop_loss == "given":
            with torch.no_grad():
                crit(model(torch.randn(8, 4)), torch.randint(0, 3, (8,)))
        for step in range(4):
            x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
            if step == 2:
                y[:] = -1
            opt.zero_grad()
            out = model(x)
            if loop_loss == "inline":
                loss = F.cross_entropy(out, y, ignore_index=-1)
            else:
                loss = (other if loop_loss == "other" else crit)(out, y)
            loss.backward()
            opt.step()


@pytest.mark.parametrize("loop_loss", ["inline", "other"])
def test_a_loss_module_the_loop_never_calls_is_said_once_at_the_first_step(
        tmp_path, caplog, loop_loss):
    """``loss_fn=nn.CrossEntropyLoss()`` given, but the loop's loss is ``F.cross_entropy`` or
    another instance: the given module's hook never runs, and step 2's 0/0 loss (zero
    gradients) trained on with no word. The first training step's close says so once, naming
    the class, the step and the fixes; no bundle is written (the case it warns of)."""
    said = _said_once(caplog, "was not called", lambda: _train_beside_module(tmp_path, loop_loss))
    assert said.startswith("nanreplay: the loss module given as loss_fn (a CrossEntropyLoss) "
                           "was not called in step 0,"), said
    assert "loss = loss_fn(output, target)" in said and "rec.record_loss(loss)" in said
    assert not list(tmp_path.glob("*.nan"))


def _said_once(caplog, phrase: str, run) -> str:
    """The one warning holding ``phrase`` that ``run()`` logged."""
    with caplog.at_level("WARNING", logger="nanreplay"):
        run()
    said = [r.getMessage() for r in caplog.records if phrase in r.getMessage()]
    assert len(said) == 1, said
    return said[0]


def test_the_loss_module_given_and_called_is_checked_and_nothing_is_said(tmp_path, caplog):
    """The same loop computing its loss with the module given (called first on a held-out
    batch before the first step): its NaN is a loss event at step 2, and nothing is said."""
    with caplog.at_level("WARNING", logger="nanreplay"):
        with pytest.raises(NonFiniteError) as info:
            _train_beside_module(tmp_path, "given")
    assert (info.value.event["step"], info.value.event["phase"]) == (2, "loss")
    assert not any("was not called" in r.getMessage() for r in caplog.records)


class _WithLoss(torch.nn.Module):
    """A classifier that returns its loss when given labels, as a Hugging Face model does."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 3)

    def forward(self, x, labels=None):
        logits = self.net(x)
        return logits if labels is None else F.cross_entropy(logits, labels, ignore_index=-1)


def _train_without_loss_fn(out_dir: Path, how: str) -> None:
    """As :func:`_train_ignored`, recorded with no ``loss_fn``: the loop's loss is
    ``F.cross_entropy`` (``"inline"``), handed to ``rec.record_loss`` (``"recorded"``), or
    the model's own output (``"output"``)."""
    torch.manual_seed(0)
    model = _WithLoss() if how == "output" else torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with FlightRecorder(model, opt, out_dir=out_dir) as rec:
        for step in range(4):
            x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
            if step == 2:
                y[:] = -1
            opt.zero_grad()
            if how == "output":
                loss = model(x, labels=y)
            else:
                loss = F.cross_entropy(model(x), y, ignore_index=-1)
            if how == "recorded":
                rec.record_loss(loss)
            loss.backward()
            opt.step()


def test_a_run_without_loss_fn_is_told_once_that_its_loss_is_unwatched(tmp_path, caplog):
    """No ``loss_fn``, no ``record_loss``, no loss in the model's output: the 0/0 loss of
    step 2 (zero gradients) trains on. The first training step's close says so once, with the
    two fixes; no bundle is written (the case it warns of)."""
    said = _said_once(caplog, "no loss_fn was given",
                      lambda: _train_without_loss_fn(tmp_path, "inline"))
    assert said.startswith("nanreplay: no loss_fn was given, and step 0's loss is neither "
                           "checked nor recorded"), said
    assert "loss_fn=criterion" in said and "rec.record_loss(loss)" in said
    assert not list(tmp_path.glob("*.nan"))


@pytest.mark.parametrize(("how", "phase"), [("recorded", "loss"), ("output", "forward")])
def test_a_loss_recorded_or_returned_by_the_model_is_checked_and_nothing_is_said(
        tmp_path, caplog, how, phase):
    """The same loss handed to ``rec.record_loss``, or returned by the model itself: its NaN
    is an event at step 2, and nothing is said."""
    with caplog.at_level("WARNING", logger="nanreplay"):
        with pytest.raises(NonFiniteError) as info:
            _train_without_loss_fn(tmp_path, how)
    assert (info.value.event["step"], info.value.event["phase"]) == (2, phase)
    assert not any("no loss_fn was given" in r.getMessage() for r in caplog.records)
