"""torch.nn layers the other tests barely use, in small real training loops (models in
``rare_layers_models``): a patch autoencoder with ``nn.Unfold``/``nn.Fold``, a bag-of-words
classifier with ``nn.EmbeddingBag`` and ``per_sample_weights``, an IRNN (``nn.RNN`` with
``nonlinearity="relu"``) over packed sequences, a char model with ``nn.LSTM(proj_size=)``, a
siamese scorer with ``nn.Bilinear``.

Each trains healthy with no event and losses bit-identical to the same loop without the
recorder; then a bug is planted at step K and ``nanreplay --json`` must name the step, module,
op, samples and cause the plant decides.
"""

from __future__ import annotations

import pytest
import rare_layers_models as M
import torch
from bundles import nanreplay_json, source_line
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from recorder import FlightRecorder, NonFiniteError

pytestmark = [pytest.mark.usefixtures("in_tests_dir"),
              pytest.mark.filterwarnings("ignore:LSTM with projections is not supported")]

B, STEPS, K, BAD = 4, 5, 3, 2  # batch, steps, the planted step, the planted sample
MODELS = "rare_layers_models.py"


def train_into(model, batches, crit, losses=None) -> None:
    """SGD steps of ``model`` over ``batches`` of ``(inputs, target)``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for inputs, y in batches:
        opt.zero_grad()
        loss = crit(model(*inputs), y)
        loss.backward()
        opt.step()
        if losses is not None:
            losses.append(loss.detach().clone())


def train(factory: str, batches, crit, out_dir=None) -> list[torch.Tensor]:
    """SGD over ``batches``; under a FlightRecorder with ``out_dir``. The losses."""
    torch.manual_seed(0)
    model = getattr(M, factory)()
    losses: list[torch.Tensor] = []
    if out_dir is None:
        train_into(model, batches, crit, losses)
        return losses
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory=f"rare_layers_models:{factory}"):
        for inputs, y in batches:
            opt.zero_grad()
            loss = crit(model(*inputs), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach().clone())
    return losses


def replayed(factory, batches, crit, out_dir) -> tuple[NonFiniteError, dict]:
    with pytest.raises(NonFiniteError) as info:
        train(factory, batches, crit, out_dir)
    err = info.value
    assert err.event["step"] == K, err.event
    rep = nanreplay_json(err.bundle_path)
    assert rep["event"]["step"] == K and rep["reproduced"], rep["event"]
    return err, rep


def origin(rep):
    o = rep["origin"]
    return o["phase"], o["module"], o["op"], o["samples"], rep["cause"]


def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1)


# ---------------------------------------------------------------------------------------------
# the data, healthy or with the plant at step K


def images(plant: bool):
    """Images of 9x9, which 3x3 patches at stride 2 tile exactly; with ``plant``, step K's
    batch is of 8x8 (another resolution bucket), whose last row and column no patch covers."""
    g = gen()
    out = []
    for i in range(STEPS):
        s = 8 if plant and i == K else 9
        x = torch.rand(B, 1, s, s, generator=g)
        out.append(((x,), x))
    return out


def documents(plant: bool, empty_at: int | None = None):
    """Bags of 1-4 words with tf-idf weights; ``empty_at``: that document of every batch is
    empty (two equal offsets); with ``plant``, document BAD of step K's batch is."""
    g = gen()
    out = []
    for i in range(STEPS):
        lens = torch.randint(1, 5, (B,), generator=g)
        if plant and i == K:
            lens[BAD] = 0
        if empty_at is not None:
            lens[empty_at] = 0
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)[:-1]])
        ids = torch.randint(0, M.VOCAB, (int(lens.sum()),), generator=g)
        weights = torch.rand(int(lens.sum()), generator=g) + 0.1
        out.append(((ids, offsets, weights), torch.randint(0, M.C, (B,), generator=g)))
    return out


LONG = 400  # a sequence long enough for the state to pass float32's range


def sequences(plant: bool):
    """Packed sequences of 3-11 steps; with ``plant``, sample BAD of step K is LONG steps."""
    g = gen()
    out = []
    for i in range(STEPS):
        lens = torch.randint(3, 12, (B,), generator=g)
        if plant and i == K:
            lens[BAD] = LONG
        x = torch.rand(B, int(lens.max()), 2, generator=g)
        out.append(((x, lens), torch.randint(0, M.C, (B,), generator=g)))
    return out


def characters(plant: bool):
    """Character ids and a side channel of features; with ``plant``, one feature of sample BAD
    at step K is NaN (a sensor's missing reading)."""
    g = gen()
    out = []
    for i in range(STEPS):
        ids = torch.randint(0, M.VOCAB, (B, 7), generator=g)
        feats = torch.randn(B, 7, 8, generator=g)
        if plant and i == K:
            feats[BAD, 4, 1] = float("nan")
        out.append(((ids, feats), torch.randint(0, M.VOCAB, (B, 7), generator=g)))
    return out


def pairs(plant: bool):
    """Pairs of records; with ``plant``, the first record of pair BAD at step K is blank."""
    g = gen()
    out = []
    for i in range(STEPS):
        x = torch.randn(B, 2, 6, generator=g)
        if plant and i == K:
            x[BAD, 0] = 0.0
        out.append(((x,), torch.randn(B, generator=g)))
    return out


class SeqCE(nn.Module):
    """Cross-entropy over ``(B, T, VOCAB)`` logits and ``(B, T)`` next characters."""

    def forward(self, logits, target):
        return nn.functional.cross_entropy(logits.transpose(1, 2), target)


CASES = {
    "patch_autoencoder": ("make_patch_autoencoder", images, nn.MSELoss()),
    "bag_of_words": ("make_bag_of_words", documents, nn.CrossEntropyLoss()),
    "bag_by_length": ("make_bag_by_length", documents, nn.CrossEntropyLoss()),
    "irnn": ("make_irnn", sequences, nn.CrossEntropyLoss()),
    "char_lstm": ("make_char_lstm", characters, SeqCE()),
    "pair_scorer": ("make_pair_scorer", pairs, nn.HuberLoss()),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_healthy_run_no_event_and_identical_losses(name, out_dir):
    factory, data, crit = CASES[name]
    plain = train(factory, data(False), crit)
    recorded = train(factory, data(False), crit, out_dir)
    assert len(recorded) == STEPS and all(torch.isfinite(v) for v in plain)
    assert all(torch.equal(a, b) for a, b in zip(plain, recorded))
    assert not out_dir.exists() or not list(out_dir.iterdir())


def test_empty_bags_under_mode_max_are_no_event(out_dir):
    """EmbeddingBag's own reduction of an empty bag (mode="max") is 0, not NaN."""
    batches = documents(False, empty_at=1)
    crit = nn.CrossEntropyLoss()
    plain = train("make_bag_max", batches, crit)
    assert all(torch.equal(a, b) for a, b in zip(plain, train("make_bag_max", batches, crit,
                                                                 out_dir)))
    assert not out_dir.exists() or not list(out_dir.iterdir())


# ---------------------------------------------------------------------------------------------
# the plants


def test_fold_overlap_count_of_an_untiled_size_names_the_uncovered_pixels(out_dir):
    """``fold(recon) / fold(unfold(ones))`` over an 8x8 batch, which 3x3 patches at stride 2
    do not tile: the last row and column are 0/0 in every image. The report named the
    division and said to add an eps or skip the rows (every row); now it names the uncovered
    row and column and the sizes that tile."""
    _, rep = replayed("make_patch_autoencoder", images(True), nn.MSELoss(), out_dir)
    assert origin(rep) == ("forward", "", "aten.div", list(range(B)), "invalid"), rep["origin"]
    assert rep["origin"]["source"] == source_line(MODELS, "# BUG uncovered")
    s = 8
    reached = (s - M.PATCH) // M.STRIDE * M.STRIDE + M.PATCH  # past the last patch's end
    uncovered = list(range(reached, s))
    assert uncovered, "the plant must leave pixels uncovered"
    assert f"leaves row(s) {uncovered} and column(s) {uncovered} uncovered" in rep["hint"], \
        rep["hint"]
    assert f"kernel {M.PATCH}x{M.PATCH} at stride {M.STRIDE}x{M.STRIDE}" in rep["hint"]
    assert f"over an output of {s}x{s}" in rep["hint"], rep["hint"]


def test_weighted_mean_of_an_empty_bag_names_the_empty_document(out_dir):
    """A tf-idf weighted mean by hand, EmbeddingBag(mode="sum") over the words divided by the
    document's total weight (``index_add``): an empty bag is 0/0. The report named the row but
    its hint was a graph's (isolated nodes, an atom's neighbour list, periodic images); now it
    names the empty record."""
    _, rep = replayed("make_bag_of_words", documents(True), nn.CrossEntropyLoss(), out_dir)
    assert origin(rep) == ("forward", "", "aten.div", [BAD], "invalid"), rep["origin"]
    assert rep["origin"]["source"] == source_line(MODELS, "# BUG empty_doc")
    assert "accumulated per sample by index_add" in rep["hint"], rep["hint"]
    assert f"it is 0 in sample(s) [{BAD}]" in rep["hint"], rep["hint"]
    assert "empty bag" in rep["hint"], rep["hint"]
    for graph_text in ("isolated nodes", "neighbour", "periodic"):
        assert graph_text not in rep["hint"], rep["hint"]


def test_mean_by_bag_length_of_an_empty_bag_names_its_document(out_dir):
    """EmbeddingBag(mode="sum") divided by the lengths the offsets give: an empty bag (two
    equal offsets) is 0/0 on its document alone."""
    _, rep = replayed("make_bag_by_length", documents(True), nn.CrossEntropyLoss(), out_dir)
    assert origin(rep) == ("forward", "", "aten.div", [BAD], "invalid"), rep["origin"]
    assert rep["origin"]["source"] == source_line(MODELS, "# BUG empty_len")


class FirstInf(TorchDispatchMode):
    """The first aten op that made an infinity from finite inputs."""

    def __init__(self):
        super().__init__()
        self.op = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.op is None and isinstance(out, torch.Tensor) and out.is_floating_point() \
                and bool(torch.isinf(out).any()):
            self.op = f"aten.{func.overloadpacket.__name__}"
        return out


def test_relu_rnn_over_a_long_sequence_names_its_recurrent_weight(out_dir):
    """An IRNN whose identity recurrent weights are scaled by 1.5: a LONG-step sequence in one
    sample grows its state as 1.5^t past float32. The report named the op and sample but its
    hint said float64 holds the value and spoke of Newton-Schulz iterations and Hopfield
    descents; now it names the ReLU recurrence and weight_hh's spectral radius."""
    batches, crit = sequences(True), nn.CrossEntropyLoss()
    _, rep = replayed("make_irnn", batches, crit, out_dir)
    torch.manual_seed(0)
    model = M.make_irnn()
    train_into(model, batches[:K], crit)  # (plain PyTorch: the weights step K began with)
    radius = float(torch.linalg.eigvals(model.rnn.weight_hh_l0.detach().double()).abs().max())
    assert radius > 1
    mode = FirstInf()
    with torch.no_grad(), mode:
        model(*batches[K][0])
    assert origin(rep) == ("forward", "rnn", mode.op, [BAD], "overflow"), rep["origin"]
    assert f"weight_hh, whose spectral radius is {radius:.3g}, above 1" in rep["hint"]
    assert "ReLU recurrence" in rep["hint"], rep["hint"]
    for misleading in ("float64 holds it", "Newton-Schulz", "Hopfield"):
        assert misleading not in rep["hint"], rep["hint"]


def test_projected_lstm_nan_feature_is_an_input_event_on_its_sample(out_dir):
    """A NaN in one sample's side-channel features before an LSTM with proj_size (its h and c
    of different widths): an input event on that sample."""
    _, rep = replayed("make_char_lstm", characters(True), SeqCE(), out_dir)
    assert (rep["origin"]["phase"], rep["origin"]["samples"], rep["cause"]) == \
        ("input", [BAD], "input"), rep["origin"]
    assert rep["origin"]["arg"] == "feats", rep["origin"]


def test_cosine_normalised_blank_record_names_its_pair(out_dir):
    """``a / a.norm()`` of a bias-free ReLU encoder's code of a blank record: 0/0 on its pair."""
    _, rep = replayed("make_pair_scorer", pairs(True), nn.HuberLoss(), out_dir)
    assert origin(rep) == ("forward", "", "aten.div", [BAD], "invalid"), rep["origin"]
    assert rep["origin"]["source"] == source_line(MODELS, "# BUG dead_code")
