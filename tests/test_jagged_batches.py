"""Variable-length batches as jagged nested tensors (``layout=torch.jagged``): a sequence
classifier whose projections, attention (``F.scaled_dot_product_attention`` over
(B, H, j, D)) and pooling run on the jagged batch. On CPU torch's math attention turns the
jagged query, key and value into strided nested tensors, which refuse most ops: the op
finder's trackers failed on them, and that failure, a ``NotImplementedError``, was taken by
the jagged tensor's ``__torch_function__`` for an op it lacks, so the re-run went on unwatched
and the report named no op ('nan made by <root>', the ``def forward`` line). A sequence of
length 0 is named as an empty record by the sizes the bundle keeps of the nested batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from replay import replay

# (torch's math attention on jagged inputs builds a strided nested tensor, which warns so)
pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")

D_IN, BATCH, STEPS, BAD_STEP, BAD_SEQ = 6, 4, 4, 2, 1


class JaggedClassifier(nn.Module):
    def __init__(self, unit_tokens: bool = False, d: int = 8, heads: int = 2):
        super().__init__()
        self.unit_tokens, self.heads = unit_tokens, heads
        self.proj, self.qkv = nn.Linear(D_IN, d), nn.Linear(d, 3 * d)
        self.out, self.head = nn.Linear(d, d), nn.Linear(d, 3)

    def forward(self, x):  # x: (B, j, D_IN), jagged
        if self.unit_tokens:  # (no eps: a token of zeros is 0/0)
            x = x / x.pow(2).sum(dim=-1, keepdim=True).sqrt()
        h = self.proj(x)

        def heads(t):  # (B, j, H*Dh) -> (B, H, j, Dh)
            return t.contiguous().unflatten(-1, (self.heads, -1)).transpose(1, 2)

        q, k, v = self.qkv(h).chunk(3, dim=-1)
        a = F.scaled_dot_product_attention(heads(q), heads(k), heads(v))
        h = h + self.out(a.transpose(1, 2).flatten(-2))
        lengths = x.offsets().diff().unsqueeze(-1).to(h.dtype)
        return self.head(h.to_padded_tensor(0.0).sum(dim=1) / lengths)  # (no guard: length 0)


def make_model(unit_tokens: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return JaggedClassifier(unit_tokens)


def batches(plant):
    g = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        seqs = [torch.randn(n, D_IN, generator=g)
                for n in torch.randint(2, 6, (BATCH,), generator=g).tolist()]
        if step == BAD_STEP and plant is not None:
            seqs[BAD_SEQ] = plant(seqs[BAD_SEQ])
        y = torch.randint(0, 3, (BATCH,), generator=g)
        if step % 2:  # (both ways users build one)
            yield torch.nested.nested_tensor(seqs, layout=torch.jagged), y
        else:
            offsets = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
            yield torch.nested.nested_tensor_from_jagged(torch.cat(seqs), offsets), y


def train(model, plant=None, out_dir=None) -> list[float]:
    opt, crit, losses = torch.optim.Adam(model.parameters(), lr=1e-2), nn.CrossEntropyLoss(), []
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir) if out_dir else \
            torch.enable_grad():
        for x, y in batches(plant):
            opt.zero_grad()
            loss = crit(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def test_a_healthy_jagged_run_is_bit_identical_with_the_recorder(tmp_path):
    assert train(make_model(), out_dir=tmp_path) == train(make_model())
    assert not list(tmp_path.iterdir())


def _event(tmp_path, plant, unit_tokens=False):
    with pytest.raises(NonFiniteError) as info:
        train(make_model(unit_tokens), plant, tmp_path)
    ev = info.value.event
    return ev, info.value.bundle_path


def test_an_empty_sequence_is_named_at_the_pooling_div_and_dropped(tmp_path):
    ev, path = _event(tmp_path, lambda s: s[:0])  # (a sequence of length 0)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == \
        (BAD_STEP, "forward", "", [BAD_SEQ])
    rep = replay(path, factory=make_model, tries=[f"drop={BAD_SEQ}"])
    o = rep["origin"]
    assert rep["reproduced"] and (o["op"], o["module"], o["samples"], rep["cause"]) == \
        ("aten.div", "", [BAD_SEQ], "invalid")
    assert "/ lengths" in rep["source_lines"][o["source"]]
    # (the bundle keeps each sequence's size: the empty one is named as such)
    assert f"Sample(s) {BAD_SEQ} are empty records: the lengths of batch" in rep["hint"]
    assert f'tries=["drop={BAD_SEQ}"]' in rep["hint"] and rep["what_if"][0]["finite"] is True


def test_a_zero_sequence_is_named_at_its_jagged_div(tmp_path):
    ev, path = _event(tmp_path, torch.zeros_like, unit_tokens=True)
    assert (ev["step"], ev["phase"], ev["samples"]) == (BAD_STEP, "forward", [BAD_SEQ])
    rep = replay(path, factory=lambda: make_model(unit_tokens=True))
    o = rep["origin"]
    assert (o["op"], o["samples"], rep["cause"]) == ("aten.div", [BAD_SEQ], "invalid")
    assert ".sqrt()" in rep["source_lines"][o["source"]]
    assert f"drop={BAD_SEQ}" in rep["hint"]


def test_an_attention_overflow_in_one_sequence_names_the_attention_line(tmp_path):
    ev, path = _event(tmp_path, lambda s: s * 1e25)  # (a record in the wrong unit)
    assert (ev["step"], ev["phase"], ev["samples"]) == (BAD_STEP, "forward", [BAD_SEQ])
    rep = replay(path, factory=make_model)
    o = rep["origin"]
    assert (o["op"], o["samples"], rep["cause"]) == ("aten.matmul", [BAD_SEQ], "overflow")
    assert "scaled_dot_product_attention" in rep["source_lines"][o["source"]]


def test_a_nan_token_is_an_input_event_of_its_sequence(tmp_path):
    def nan_token(s):
        s = s.clone()
        s[1, 3] = float("nan")
        return s

    ev, path = _event(tmp_path, nan_token)
    assert (ev["step"], ev["phase"], ev["samples"]) == (BAD_STEP, "input", [BAD_SEQ])
    rep = replay(path, factory=make_model)
    assert (rep["cause"], rep["origin"]["samples"]) == ("input", [BAD_SEQ])
