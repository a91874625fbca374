"""End to end on training with ``torch.compile`` (``compiled_training_models``), on CPU as its
users write it: a small transformer LM whose repeated blocks are compiled one by one (regional
compilation, ``dynamic=True`` for batches padded to their longest sequence), SDPA with the key
padding mask passed into ``forward``; a compiled loss module (a hand-written cross-entropy
behind a temperature); the whole model compiled; a compiled ``opt.step`` with its learning rate
in a tensor; bfloat16 autocast around a compiled model. Each planted bug fires under the
recorder and is replayed eagerly with the CLI, which names the op inside the compiled region;
the healthy run raises no event, trains bit-identically and compiles the same graphs (dynamo's
counters) with and without the recorder."""

from __future__ import annotations

import contextlib
import json

import compiled_training_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch._dynamo.utils import counters

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle

pytestmark = [
    pytest.mark.usefixtures("in_tests_dir"),
    # (dynamo reads .grad of a compiled block's non-leaf input when guarding it, recorder or not)
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf"),
]

STEPS = 3
BACKEND = "aot_eager"  # dynamo and AOTAutograd as inductor sees them, without C++ builds


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def line_of(text: str) -> str:
    return source_line("compiled_training_models.py", text)


def padded(data) -> list[int]:
    """The samples of the first batch shorter than its longest sequence (they hold pad ids)."""
    lengths = data.lengths[:M.B]
    return [i for i, k in enumerate(lengths) if k < max(lengths)]


def train_lm(out_dir, make: str = "make_lm", loss=None, plant=None, record: bool = True,
             whole: bool = False, backend: str = BACKEND):
    """Three batches of the LM: blocks compiled one by one (``whole``: the model compiled),
    the loss module compiled, AdamW with the gradient norm clipped at 1. Returns the model and
    the data."""
    model = getattr(M, make)()
    if whole:
        model = torch.compile(model, backend=backend, dynamic=True)
    else:
        M.compile_blocks(model, backend=backend, dynamic=True)
    criterion = torch.compile(loss or M.MaskedLM(), backend=backend, dynamic=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = M.Sequences(STEPS * M.B)
    if plant is not None:
        plant(data)
    rec = FlightRecorder(model, opt, loss_fn=criterion, out_dir=out_dir,
                         factory=f"compiled_training_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        criterion = rec.loss_fn if rec is not None else criterion  # (a function's: hooked)
        for ids, keep, _ in M.loader(data):
            loss = criterion(model(ids, keep), ids, keep)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    return model, data


def fire(fn, *args, **kw):
    with pytest.raises(NonFiniteError) as info:
        fn(*args, **kw)
    return info.value.event, info.value.bundle_path


def test_healthy_run_raises_nothing_trains_bit_identically_and_compiles_the_same(tmp_path):
    """Regional compilation with dynamic shapes and a compiled loss: no event, no bundle, the
    same weights after three steps, and the same graphs (no recompilation, no graph break)
    with and without the recorder."""
    recorded, _ = train_lm(tmp_path, backend="eager")  # (dynamo's graphs, traced faster)
    seen = (dict(counters["stats"]), dict(counters["graph_break"]),
            dict(counters["recompiles"]))
    torch._dynamo.reset()
    counters.clear()
    bare, _ = train_lm(None, record=False, backend="eager")
    assert seen == (dict(counters["stats"]), dict(counters["graph_break"]),
                    dict(counters["recompiles"]))
    assert seen[0]["unique_graphs"] == 2 and not seen[1]  # one block graph, one loss graph
    for (name, a), b in zip(recorded.state_dict().items(), bare.state_dict().values()):
        assert torch.equal(a, b), name
    assert not list(tmp_path.rglob("*.nan"))


def test_rmsnorm_without_eps_on_pad_tokens_named_inside_the_compiled_block(tmp_path):
    """A port with ``eps=0`` in RMSNorm: a pad token's embedding is 0 (``padding_idx``), so
    ``x / sqrt(mean(x^2))`` is 0/0 in the first block's ``norm1``, on every sample shorter
    than the batch's longest. The recorder sees the compiled block as one call; the eager
    replay names the op and the eps that guarded nothing."""
    ev, bundle = fire(train_lm, tmp_path, make="make_lm_no_eps")
    data = M.Sequences(STEPS * M.B)
    rows = padded(data)
    assert (ev["step"], ev["phase"], ev["module"], ev["compiled"], ev["samples"]) == \
        (0, "forward", "blocks.0", True, rows)
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"]) == ("blocks.0.norm1", "aten.div", rows)
    assert rep["cause"] == "invalid" and rep["reproduced"] is True
    assert o["source"] == line_of("return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True)")
    assert "eps added to that input is exactly 0" in rep["hint"]


def test_compiled_loss_module_with_a_low_temperature_overflows_exp(tmp_path):
    """The compiled loss module (``torch.compile(MaskedLM(temperature=0.01))``): the logits
    over 0.01 reach exp's overflow in the written-out logsumexp. The bundle described the
    ``OptimizedModule`` wrapper as the loss, whose rebuild recursed in its ``__getattr__``
    (``nanreplay: replay failed (RecursionError)``); the loss is now described as the module
    it wraps, and the event says the loss is compiled."""
    ev, bundle = fire(train_lm, tmp_path, loss=M.MaskedLM(temperature=0.01))
    assert (ev["step"], ev["phase"], ev["module"], ev["compiled"]) == (0, "loss", "<loss>", True)
    loss = read_bundle(bundle)[0]["loss"]
    assert loss["class"] == "compiled_training_models.MaskedLM"
    assert loss["config"] == {"temperature": 0.01}
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"]) == ("loss", "<loss>", "aten.exp")
    assert o["samples"] == list(range(M.B))
    assert rep["cause"] == "overflow" and rep["reproduced"] is True
    assert o["source"] == line_of("lse = torch.log(torch.exp(logits).sum(-1))")
    assert "torch.logsumexp" in rep["hint"]


def train_sphere(out_dir, plant=None, record: bool = True, backend: str = BACKEND):
    """The sequence classifier compiled whole (``dynamic=True``; its ``.item()`` breaks the
    graph), label-smoothed cross-entropy, Adam. Returns the model and the data."""
    model = torch.compile(M.make_sphere(), backend=backend, dynamic=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    data = M.Sequences(STEPS * M.B, seed=1)
    if plant is not None:
        plant(data)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory="compiled_training_models:make_sphere") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        for ids, keep, y in M.loader(data):
            crit(model(ids, keep), y).backward()
            opt.step()
            opt.zero_grad()
    return model, data


def test_a_graph_break_in_forward_is_the_model_own_and_no_warning_at_attach(tmp_path, caplog):
    """The whole compiled model with ``.item()`` in forward: the recorder adds no graph break
    and no recompilation to dynamo's, trains bit-identically, and says nothing at attach (it
    warned that ``OptimizedModule has no forward of its own``, the advice for an RL agent's
    container, for every ``torch.compile(model)``)."""
    recorded, _ = train_sphere(tmp_path, backend="eager")
    seen = (dict(counters["stats"]), dict(counters["graph_break"]),
            dict(counters["recompiles"]))
    assert sum(seen[1].values()) >= 1  # the model's own .item()
    assert not [r for r in caplog.records if "nanreplay" in r.getMessage()]
    torch._dynamo.reset()
    counters.clear()
    bare, _ = train_sphere(None, record=False, backend="eager")
    assert seen == (dict(counters["stats"]), dict(counters["graph_break"]),
                    dict(counters["recompiles"]))
    for (name, a), b in zip(recorded.state_dict().items(), bare.state_dict().values()):
        assert torch.equal(a, b), name
    assert not list(tmp_path.rglob("*.nan"))


def empty_document(data):
    data.seqs[M.B + 3] = torch.zeros(5, dtype=torch.long)  # BUG: every token mapped to pad


def test_backward_only_nan_of_a_zero_pooled_vector_through_the_compiled_model(tmp_path):
    """A document whose tokens all became pad: its masked mean is the zero vector, whose
    ``sqrt`` of the sum of squares is 0 (the forward clamps after the root and stays finite),
    and ``SqrtBackward0`` makes NaN in the backward through the compiled model, on that sample
    only."""
    ev, bundle = fire(train_sphere, tmp_path, plant=empty_document)
    assert (ev["step"], ev["phase"]) == (1, "backward")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"]) == \
        ("backward", "pool", "SqrtBackward0", [3])
    assert rep["cause"] == "invalid" and rep["reproduced"] is True
    assert o["source"] == line_of("norm = torch.sqrt((z * z).sum(-1, keepdim=True))")
    assert "torch.linalg.vector_norm" in rep["hint"]
    assert rep["event"]["through_compiled"] is True


def test_a_backward_nan_only_the_compiled_graphs_made_is_said_as_such(tmp_path):
    """A backward event of a compiled model that the eager replay does not make again (here
    simulated: the recorded batch put back as the loader gave it, every document with a real
    token) was "not reproduced" with no word of compilation: the note of a compiled region's
    forward event did not cover the gradients its backward graphs made. The report now says
    the gradients came from compiled backward graphs that the replay ran eagerly."""
    from bundles import rewrite

    ev, bundle = fire(train_sphere, tmp_path, plant=empty_document)
    data = M.Sequences(STEPS * M.B, seed=1)
    ids, keep, _ = M.collate([data[i] for i in range(M.B, 2 * M.B)])
    healthy = rewrite(bundle, tmp_path / "x" / "healthy.nan",
                      tensors=lambda t: {**t, "batch/0/0": ids, "batch/0/1": keep})
    rep = nanreplay_json(healthy, code=1)
    assert rep["event"]["step"] == 1 and rep["event"]["through_compiled"] is True
    assert rep["reproduced"] is False and rep["cause"] == "not_reproduced"
    assert any("backward graphs of torch.compile'd modules" in p for p in rep["problems"]), \
        rep["problems"]


def test_compiled_optimizer_step_with_a_tensor_lr_from_a_zero_warmup(tmp_path):
    """``torch.compile(opt.step)`` with the learning rate in a tensor (the recipe that keeps a
    schedule from recompiling the step), set by ``base * min(step / warmup, 1)`` with
    ``warmup=0`` in the config: 0/0 at step 0 in tensor arithmetic raises nothing, the lr is
    NaN and Adam's update writes NaN into every weight. Replayed from the copies before the
    update (``guard_optimizer=True``), the update is named with the lr that broke it."""
    model = M.make_sphere()
    lr = torch.tensor(1e-3)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    step_fn = torch.compile(opt.step, backend=BACKEND)
    crit = torch.nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path, guard_optimizer=True,
                            factory="compiled_training_models:make_sphere"):
            for step, (ids, keep, y) in enumerate(M.loader(M.Sequences(STEPS * M.B, seed=1))):
                crit(model(ids, keep), y).backward()
                lr.fill_(M.warmup_lr(torch.tensor(float(step)), 1e-3, warmup=0))
                step_fn()
                opt.zero_grad()
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (0, "optimizer")
    assert not counters["graph_break"]  # the optimizer's hooks stay outside the step's graph
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["op"]) == ("optimizer", "aten.addcdiv_")
    assert rep["cause"] == "optimizer" and rep["reproduced"] is True
    assert "its lr was nan in that update" in rep["hint"]


def raw_readings(x) -> list[int]:
    """BUG: the second batch's windows in raw sensor units (around 300, not standardised);
    the rows of it whose one-pass bfloat16 variance comes out below 0."""
    x[16:32] = 300.0 + 3.0 * x[16:32]
    w = x[16:32].to(torch.bfloat16)
    mean = w.mean(-1, keepdim=True)
    var = ((w * w).mean(-1, keepdim=True) - mean * mean).squeeze(-1)
    return torch.nonzero(var < 0).flatten().tolist()


def train_features(out_dir, x, y):
    """The bfloat16 regression model compiled whole, SGD with momentum, batches of 16."""
    model = torch.compile(M.make_feature_net(), backend=BACKEND)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    crit = torch.nn.MSELoss()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory="compiled_training_models:make_feature_net"):
        for xb, yb in data:
            crit(model(xb).float(), yb).backward()
            opt.step()
            opt.zero_grad()


def test_one_pass_variance_in_bfloat16_cancels_below_zero_in_the_compiled_model(tmp_path):
    """The model trained in bfloat16 and compiled whole; raw readings around 300 make
    ``E[x^2] - E[x]^2`` cancel to -512 on some windows and ``rsqrt`` NaN there. The float64
    re-run has a positive variance: precision, with the stable formula as the hint."""
    x, y = M.features(STEPS * 16)
    rows = raw_readings(x)
    assert rows  # (the planted batch does cancel)
    with pytest.raises(NonFiniteError) as info:
        train_features(tmp_path, x, y)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["compiled"], ev["samples"]) == \
        (1, "forward", "", True, rows)
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"]) == ("norm", "aten.rsqrt", rows)
    assert rep["cause"] == "precision" and rep["reproduced"] is True
    assert o["source"] == line_of("return (x - mean) * torch.rsqrt(var + 1e-6) * self.weight")
    assert "torch.var" in rep["hint"]


def single_token_batch(data):
    """BUG: the second batch holds only one-token sequences (a length-bucketing sampler's
    shortest bucket): no next token to predict, every target weight 0."""
    for i in range(M.B, 2 * M.B):
        data.seqs[i] = data.seqs[i][:1]


def test_compiled_loss_function_is_replayed_as_the_function_it_compiled(tmp_path):
    """``torch.compile(shifted_cross_entropy)`` given as ``loss_fn``: the bundle described the
    compiled wrapper, whose ``module:qualname`` imports the eager function, not the wrapper,
    so the loss was "not importable" and never re-run (no op, no cause). Described as the
    function it compiled (and marked compiled), the replay names the 0/0 of the masked mean
    over a batch with no target."""
    ev, bundle = fire(train_lm, tmp_path, loss=M.shifted_cross_entropy,
                      plant=single_token_batch)
    assert (ev["step"], ev["phase"], ev["module"]) == (1, "loss", "<loss>")
    loss = read_bundle(bundle)[0]["loss"]
    assert (loss["import"], loss["compiled"]) == \
        ("compiled_training_models:shifted_cross_entropy", True)
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"]) == ("loss", "<loss>", "aten.div")
    assert rep["cause"] == "invalid" and rep["reproduced"] is True
    assert rep["event"]["compiled"] is True
    assert o["source"] == line_of("return ((nll + 1e-4 * log_z ** 2) * w).sum() / w.sum()")
    assert "count.clamp_min(1)" in rep["hint"]


def test_compiled_loss_with_a_trained_temperature_started_at_zero(tmp_path):
    """A loss module with a learned temperature, compiled and trained with the model, started
    at 0 from the config: x/0 at step 0. The recorder named the loss's parameter through the
    compile wrapper (``<loss>._orig_mod.temperature``), which the eagerly rebuilt loss lacks:
    the replay stopped ("the rebuilt loss has no parameter '_orig_mod.temperature'"). The
    parameter is named as the user wrote it (``<loss>.temperature``), in the bundle and in
    the report, and the replay names the division by it."""
    model = M.compile_blocks(M.make_lm(), backend=BACKEND, dynamic=True)
    loss = M.LearnedTemperatureLM(temperature=0.0)
    criterion = torch.compile(loss, backend=BACKEND, dynamic=True)
    opt = torch.optim.AdamW([{"params": model.parameters()},
                             {"params": loss.parameters(), "weight_decay": 0.0}], lr=1e-3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=criterion, out_dir=tmp_path,
                            factory="compiled_training_models:make_lm"):
            for ids, keep, _ in M.loader(M.Sequences(STEPS * M.B)):
                criterion(model(ids, keep), ids, keep).backward()
                opt.step()
                opt.zero_grad()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["compiled"]) == (0, "loss", "<loss>", True)
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"]) == \
        ("loss", "<loss>", "aten.div", list(range(M.B)))
    assert rep["cause"] == "invalid" and rep["reproduced"] is True
    assert o["source"] == line_of("scaled = logits / self.temperature")
    assert "temperature" in rep["hint"] and "learn its log" in rep["hint"]
    assert "_orig_mod" not in json.dumps(rep), rep


def test_a_missing_reading_is_the_batch_not_the_compiled_model(tmp_path):
    """A NaN reading (a sensor's dropout the pipeline never imputed) in the second batch: the
    input guard of the compiled model names the sample and the feature before any op runs."""
    x, y = M.features(STEPS * 16)
    x[16 + 6, 2] = float("nan")
    with pytest.raises(NonFiniteError) as info:
        train_features(tmp_path, x, y)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (1, "input", "", [6])
    rep = nanreplay_json(info.value.bundle_path)
    assert (rep["origin"]["phase"], rep["origin"]["samples"]) == ("input", [6])
    assert rep["cause"] == "input" and rep["reproduced"] is True
    assert "sample 6 at feature(s) 2 (of 8)" in rep["hint"]
