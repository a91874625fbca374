"""End to end: a model whose constructor takes a config object (nanoGPT's ``GPT(config)``
keeping ``self.config``, ``Net(args)``, an OmegaConf or Hugging Face config), recorded without
a factory, is rebuilt by ``nanreplay bundle.nan`` from the bundle alone with the run's values
(not the class's defaults: a default ``eps`` would not reproduce the NaN), and the report names
the step, module, op, samples and cause; a constructor argument kept as no data (a lambda),
or the replay run from another directory, gets one line saying what to pass."""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import config_models as CM
import pytest
import torch
from bundles import replay_report

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

STEP, ROW = 2, 4  # the step whose batch holds a constant row, and that row


def record(tmp_path, model, x_shape=(6, CM.DIM)) -> Path:
    """Four SGD steps of ``model``; at step STEP sample ROW is a constant row, which a norm
    with ``eps=0`` divides as 0 / 0."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    crit = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path):
            for step in range(4):
                x = torch.randn(*x_shape, generator=g)
                if step == STEP:
                    x[ROW] = 1.0
                y = torch.randint(0, 3, (x_shape[0],), generator=g)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    return info.value.bundle_path


def gpt():
    norm = CM.NormConfig(eps=0.0)  # (nested, unused by the layers: kept as recorded)
    return CM.GPT(CM.GPTConfig(n_layer=2, norm=norm, widths=(CM.DIM, 5), act=CM.Act.RELU,
                               dtype=torch.float32, out=Path("runs/a"), act_layer=torch.nn.ReLU,
                               norm_layer=functools.partial(torch.nn.LayerNorm, eps=0.0)))


def omegaconf_net():
    omegaconf = pytest.importorskip("omegaconf")
    return CM.ArgsNet(omegaconf.OmegaConf.create({"eps": 0.0, "widths": [CM.DIM, 5, 3]}))


def hf_net():
    pytest.importorskip("transformers")
    import config_hf_models as HF
    return HF.TinyModel(HF.TinyConfig(n_layers=2, layer_norm_eps=0.0))


@pytest.mark.parametrize("make, norm, call", [
    pytest.param(gpt, "norms.0", "config_models:GPT(config=self.config)", id="dataclass"),
    pytest.param(lambda: CM.ArgsNet(argparse.Namespace(eps=0.0, widths=[CM.DIM, 5, 3])),
                 "norm", "config_models:ArgsNet(args=self.args)", id="Namespace"),
    pytest.param(lambda: CM.ArgsNet({"eps": 0.0, "widths": [CM.DIM, 5, 3]}),
                 "norm", "config_models:ArgsNet(args=self.args)", id="dict"),
    pytest.param(omegaconf_net, "norm", "config_models:ArgsNet(args=self.args)",
                 id="DictConfig"),
    pytest.param(hf_net, "norm", "config_hf_models:TinyModel(config=self.config)",
                 id="PretrainedConfig")])
def test_a_config_built_model_is_rebuilt_with_the_runs_values(tmp_path, make, norm, call):
    rep, code = replay_report(record(tmp_path, make()))
    assert (rep["reproduced"], code) == (True, 0), rep
    origin = rep["origin"]
    assert (rep["event"]["step"], origin["module"], origin["op"], origin["samples"],
            rep["cause"]) == (STEP, norm, "aten.native_layer_norm", [ROW], "invalid"), origin
    assert f"the model was rebuilt as {call}, the constructor arguments" in " ".join(
        rep["problems"]), rep["problems"]
    assert f"Here {norm} is an nn.LayerNorm built with eps=0" in rep["hint"], rep["hint"]


def test_an_attention_scale_of_0_from_the_config(tmp_path):
    """``attn_scale = 0`` multiplies the causal mask's -inf by 0 in every row, from step 0."""
    model = CM.Attention(argparse.Namespace(attn_scale=0.0))
    rep, code = replay_report(record(tmp_path, model, x_shape=(6, 3, CM.DIM)))
    origin = rep["origin"]
    assert (rep["reproduced"], rep["event"]["step"], origin["module"], origin["op"],
            rep["cause"]) == (True, 0, "", "aten.mul", "invalid"), origin
    assert origin["samples"] == list(range(6))


def test_replayed_from_another_directory(tmp_path, monkeypatch):
    """Away from the run's directory the class is not trusted: one line naming it and that
    directory; ``--factory`` naming the class trusts it, called with the kept config."""
    bundle = record(tmp_path, gpt())
    ran = Path.cwd()
    monkeypatch.chdir(tmp_path)
    rep, code = replay_report(bundle)
    assert (rep["not_rerun"], code) == ("factory not imported", 1)
    [note] = [p for p in rep["problems"] if "no model factory" in p]
    assert "rebuilt as config_models:GPT(config=self.config)" in note, note
    assert "--factory config_models:GPT" in note and f"the run ran in {ran})" in note, note
    rep, code = replay_report(bundle, "--factory", "config_models:GPT")
    assert (rep["reproduced"], rep["origin"]["module"], rep["origin"]["samples"]) == (
        True, "norms.0", [ROW]), rep


def test_a_lambda_argument_is_named(tmp_path):
    rep, code = replay_report(record(tmp_path, CM.ActNet(lambda x: torch.log(x - 1.0))))
    assert (rep["not_rerun"], code) == ("factory not imported", 1)
    [note] = [p for p in rep["problems"] if "no model factory" in p]
    assert "its class config_models:ActNet takes 'act' (self.act holds " in note, note
    assert "(lambda), which is no data)" in note and "pass --factory MOD:FN" in note, note


def test_kept_values_that_are_no_arguments_fall_back_to_the_defaults(tmp_path):
    rep, code = replay_report(record(tmp_path, CM.NamedActNet()))
    origin = rep["origin"]
    assert (rep["reproduced"], rep["event"]["step"], origin["module"], origin["samples"],
            rep["cause"]) == (True, STEP, "norm", [ROW], "invalid"), origin
    notes = " ".join(rep["problems"])
    assert "(config_models:NamedActNet(act=self.act)) does not rebuild it" in notes, notes
    assert "rebuilt as config_models:NamedActNet() with its default arguments" in notes, notes


def test_a_bundle_cannot_hand_the_model_an_installed_packages_function(tmp_path):
    """A bundle whose kept ``norm_layer`` is edited into ``partial(<an installed package's
    function>, <its own arguments>)`` — which the model would call at construction — is
    refused in one line and the function never runs; torch.nn's layers (the recorded one) and
    the run's own code stay accepted (the tests above)."""
    from bundles import rewrite

    def edit(m):
        cfg = m["model"]["init"]["args"]["config"]["fields"]
        cfg["norm_layer"] = {"t": "partial", "func": {"t": "import", "import": "numpy:save"},
                             "args": [str(tmp_path / "written")], "keywords": {}}
        return m

    bundle = rewrite(record(tmp_path, gpt()), tmp_path / "edited.nan", meta=edit)
    rep, code = replay_report(bundle)
    assert code == 1 and rep["reproduced"] is not True, rep
    note = " ".join(rep["problems"])
    assert "the recorded callable numpy:save is neither the run's own code nor a torch.nn " \
        "layer or function" in note, note
    # (``norm_layer(DIM)`` would have been ``numpy.save(tmp_path / "written", DIM)``)
    assert not list(tmp_path.glob("written*"))
