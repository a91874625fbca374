"""Custom autograd in the model's own code: gradient hooks a forward registers
(``h.register_hook``), custom ``autograd.Function``s, penalties that differentiate the model.
Each test trains as a user would, runs ``nanreplay BUNDLE --json`` and asserts where the
non-finite value was made."""

from __future__ import annotations

import json
from pathlib import Path

import autograd_models as A
import pytest
import torch
from bundles import invoke_cli
from torch import nn

from recorder import FlightRecorder, NonFiniteError

HERE = Path(__file__).parent
K = 3


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _line(text: str) -> str:
    lines = (HERE / "autograd_models.py").read_text().splitlines()
    return f"autograd_models.py:{next(i for i, t in enumerate(lines, 1) if text in t)}"


def train_padded(factory: str, out_dir: Path) -> NonFiniteError:
    """SGD with cross entropy on ``autograd_models.<factory>()``; at step 3 row 5's label is
    the padding index the loss ignores, so its gradient is all 0."""
    model = getattr(A, factory)()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.CrossEntropyLoss(ignore_index=-100)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory=f"autograd_models:{factory}"):
            for step in range(6):
                x, y = A.batch(step)
                if step == K:
                    y[5] = -100  # a padded row
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    return info.value


def test_a_gradient_hook_that_divides_by_a_zero_norm_is_named_not_the_next_node(tmp_path):
    """The hook normalising each row of a hidden gradient divides row 5's zero gradient by its
    zero norm. The engine runs the hook before TanhBackward0, which anomaly mode then blames;
    no node made the NaN from finite incoming gradients, so the report named no op, no
    samples, and a derivative's pole as the cause. It names the hook's aten.div, its line,
    the root that registered it and sample 5."""
    err = train_padded("make_grad_normalised", tmp_path)
    rep = json.loads(invoke_cli(err.bundle_path, "--json").stdout)
    o = rep["origin"]
    line = _line("h.register_hook(lambda g")
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], o["node"], o["samples"],
            rep["cause"], rep["reproduced"]) == (
        K, "backward", "", "aten.div", "a gradient hook", [5], "invalid", True), o
    assert (o["source"], o["node_source"]) == (line, line)
    assert "aten.div of 0 by 0" in rep["hint"] and f"registered at {line}" in rep["hint"]
    text = invoke_cli(err.bundle_path).stdout
    assert f"nan made by aten.div of a gradient hook ({line}) in" in text, text


def test_a_parameter_hook_the_model_registers_when_built_runs_in_the_replay(tmp_path):
    """The model's constructor registers a hook normalising each row of the embedding's
    gradient; at step 3 the batch holds only 6 of the 8 tokens, and the rows of the other two
    are 0 / 0. The replay put the bundle's weights into new parameters, which dropped the
    factory's hooks: every gradient came back finite ('NOT reproduced'). The hooks now come
    along, and the one that made the NaN is named: its aten.div, in emb, on emb.weight."""
    model = A.make_row_normalised_bag()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="autograd_models:make_row_normalised_bag"):
            for step in range(6):
                tokens, y = A.token_batch(step, vocab=6 if step == K else 8)
                opt.zero_grad()
                crit(model(tokens), y).backward()
                opt.step()
    assert info.value.event["step"] == K
    rep = json.loads(invoke_cli(info.value.bundle_path, "--json").stdout)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["node"], o["params"], rep["cause"],
            rep["reproduced"]) == ("backward", "emb", "aten.div", "a gradient hook",
                                   ["emb.weight"], "invalid", True), rep
    line = _line("self.emb.weight.register_hook")
    assert o["source"] == line and f"on parameter emb.weight defined at {line}" in rep["hint"]


def test_a_loss_differentiated_with_autograd_grad_is_not_said_to_be_non_finite(tmp_path):
    """A loop that updates fast weights by hand: torch.autograd.grad of the loss_fn's loss,
    then p -= lr * g (no optimizer, rec.end_step() before the update). At step 3 row 5 is
    padding (input and target 0), the distance's sqrt is at 0 and its backward +inf. The
    gradient entering the output is the event; its detail said 'every parameter's gradient is
    finite: the loss, computed outside the recorder, is non-finite', where no gradient was
    written and the loss was loss_fn's, finite. The recorder now sees the gradients
    autograd.grad returns as they pass: the event is the parameter's, as under backward(). The
    replay names SqrtBackward0 in the loss."""
    model, crit = A.make_regressor(), A.DistanceLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, None, loss_fn=crit, out_dir=tmp_path,
                            factory="autograd_models:make_regressor") as rec:
            for step in range(6):
                x, _ = A.batch(step)
                y = torch.tanh(x[:, :4])
                if step == K:
                    x[5], y[5] = 0.0, 0.0  # a padded row
                grads = torch.autograd.grad(crit(model(x), y), list(model.parameters()))
                rec.end_step()
                with torch.no_grad():
                    for p, g in zip(model.parameters(), grads):
                        p -= 0.05 * g
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (K, "backward"), ev
    assert "non-finite gradient in 1 parameter(s)" in ev["detail"], ev["detail"]
    assert "computed outside the recorder" not in ev["detail"]
    rep = json.loads(invoke_cli(info.value.bundle_path, "--json").stdout)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"], rep["reproduced"]) == (
        "backward", "<loss>", "SqrtBackward0", [5], "invalid", True), rep


def test_a_module_backward_hook_is_named_as_such_not_as_a_custom_functions_backward(tmp_path):
    """The same normalisation as a module backward hook on the activation
    (register_full_backward_hook, in the constructor). Its node, BackwardHookFunctionBackward,
    was reported as a custom autograd.Function whose 'derivative of backwardhookfunction has a
    pole'; it is the module's hook, named with the op of its code and that op's cause."""
    err = train_padded("make_backward_hooked", tmp_path)
    rep = json.loads(invoke_cli(err.bundle_path, "--json").stdout)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], o["node"], o["samples"],
            rep["cause"], rep["reproduced"]) == (
        K, "backward", "act", "aten.div", "a module backward hook", [5], "invalid", True), o
    assert o["source"] == _line("return (g / g.norm(dim=1, keepdim=True),)")
    assert rep["hint"].startswith("a backward hook of module act (register_full_backward_hook)")
    assert "aten.div of 0 by 0" in rep["hint"] and "backwardhookfunction" not in rep["hint"]
    assert not any("custom autograd.Function" in p for p in rep["problems"]), rep["problems"]


def test_a_hook_the_loop_puts_on_the_output_is_named_not_loss_terms_outside_loss_fn(tmp_path):
    """The loop normalises the gradient entering the model's output with a hook it registers
    after each forward; row 5's gradient is 0 (a padded label) and the hook's 0/0 reaches
    every weight. The loss_fn re-runs finite, so the replay said the loop's loss held 'terms
    computed outside' loss_fn. The bundle now lists the hooks on the output, and the note and
    hint name that one, by the line it is defined at."""
    model = A.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.CrossEntropyLoss(ignore_index=-100)

    def unit_rows(g):
        return g / g.norm(dim=1, keepdim=True)

    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="autograd_models:make_mlp"):
            for step in range(6):
                x, y = A.batch(step)
                if step == K:
                    y[5] = -100  # a padded row
                opt.zero_grad()
                out = model(x)
                out.register_hook(unit_rows)
                crit(out, y).backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["phase"]) == (K, "backward")
    rep = json.loads(invoke_cli(info.value.bundle_path, "--json").stdout)
    at = f"test_custom_autograd.py:{unit_rows.__code__.co_firstlineno}"
    assert rep["origin"]["samples"] == [5] and rep["reproduced"] is True, rep
    assert f"gradient hook on the model's output (out.register_hook, defined at {at})" \
        in rep["hint"], rep["hint"]
    assert any(f"the loop's gradient hook on the model's output (defined at {at})" in p
               for p in rep["problems"]), rep["problems"]
    assert "terms computed outside" not in json.dumps(rep)
