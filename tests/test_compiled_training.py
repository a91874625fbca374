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
    recorded, _ = train_lm(tmp_path)
    seen = (dict(counters["stats"]), dict(counters["graph_break"]),
            dict(counters["recompiles"]))
    torch._dynamo.reset()
    counters.clear()
    bare, _ = train_lm(None, record=False)
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
