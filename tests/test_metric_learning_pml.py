"""End to end: deep metric learning with pytorch-metric-learning (``metric_learning_pml_models``):
an embedding network trained on class-clustered records drawn by ``MPerClassSampler``, with
pml's losses as their users write them (a miner's tuples, ArcFace with its own optimizer and
weights imprinted from class means, NT-Xent with an annealed temperature) and hand-written ones
(SupCon, batch-hard triplet, soft nearest neighbour), until a planted bug fires; then replayed
with the CLI."""

from __future__ import annotations

import metric_learning_pml_models as M
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from bundles import nanreplay_json, source_line
from pytorch_metric_learning import losses, samplers
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")
BATCH = 16


def line_of(text: str) -> str:
    return source_line("metric_learning_pml_models.py", text)


def imprint(model, loss_fn, ds):
    """Weight imprinting: ArcFace's class weights set to the normalised class-mean embeddings."""
    with torch.no_grad():
        e = F.normalize(model(ds.x))
        means = torch.stack([e[ds.labels == c].mean(0) for c in range(M.N_CLASSES)])
        loss_fn.W.data = F.normalize(means).t().contiguous()


def loader_of(ds, n: int, sampler: bool) -> DataLoader:
    s = samplers.MPerClassSampler(ds.labels, m=4, batch_size=BATCH,
                                  length_before_new_iter=n) if sampler else None
    return DataLoader(ds, batch_size=BATCH, sampler=s)


def order(n: int, epochs: int) -> list[int]:
    """The records MPerClassSampler draws, epoch after epoch (its NumPy draws, seeded as
    :func:`train` seeds them)."""
    np.random.seed(0)
    s = samplers.MPerClassSampler(M.Records(n).labels, m=4, batch_size=BATCH,
                                  length_before_new_iter=n)
    return [int(i) for _ in range(epochs) for i in s]


def train(out_dir, loss_fn, factory: str = "make_net", miner=None, epochs: int = 3,
          n: int = 64, sampler: bool = True, scale: float = 1.0, loss_lr: float | None = None,
          bf16: bool = False, blank: int | None = None, nan_row: int | None = None,
          anneal=None, imprinted: bool = False, fp16: bool = False, record: bool = True):
    """pml's training loop: the model's Adam and, for a loss with weights, its own SGD
    (``loss_optimizer``) stepped beside it; ``anneal(epoch)`` sets the loss's temperature;
    ``bf16``: the forward and the loss under bfloat16 autocast; ``fp16``: under float16, with
    a GradScaler that steps the model's optimizer only (the loss's is stepped directly). ``blank``: a record of zeros;
    ``nan_row``: a record with a NaN feature; ``scale``: features left unstandardised."""
    np.random.seed(0)  # (MPerClassSampler draws from NumPy's global generator)
    model = getattr(M, factory)()
    ds = M.Records(n, scale=scale)
    if blank is not None:
        ds.x[blank] = 0.0
    if nan_row is not None:
        ds.x[nan_row, 2] = float("nan")
    if imprinted:
        imprint(model, loss_fn, ds)
    loader = loader_of(ds, n, sampler)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_opt = torch.optim.SGD(loss_fn.parameters(), lr=loss_lr) if loss_lr else None
    scaler = torch.amp.GradScaler("cpu") if fp16 else None
    rec = FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir, scaler=scaler,
                         factory=f"metric_learning_pml_models:{factory}") if record else None
    with rec or torch.enable_grad():
        loss_func = rec.loss_fn if rec else loss_fn
        for epoch in range(epochs):
            if anneal is not None:
                loss_fn.temperature = anneal(epoch)
            for x, y in loader:
                opt.zero_grad()
                if loss_opt:
                    loss_opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16 if fp16 else torch.bfloat16,
                                    enabled=bf16 or fp16):
                    embeddings = model(x)
                    tuples = miner(embeddings, y) if miner else None
                    loss = loss_func(embeddings, y, tuples) if miner else loss_func(embeddings, y)
                (scaler.scale(loss) if scaler else loss).backward()
                scaler.step(opt) if scaler else opt.step()
                if loss_opt:
                    loss_opt.step()
                if scaler:
                    scaler.update()
    return model


def replayed(tmp_path, loss_fn, step: int, phase: str, **kw) -> dict:
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, loss_fn, **kw)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (step, phase), err.event
    return nanreplay_json(err.bundle_path)


def outcome(rep: dict) -> tuple:
    o = rep["origin"]
    return rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]


@pytest.mark.parametrize("loss", ["triplet", "xbm"])
def test_healthy_run_has_no_event_and_trains_bit_identically(tmp_path, loss):
    # a triplet loss given a miner's tuples; CrossBatchMemory, whose memory the forward writes
    make = {"triplet": M.triplet_loss, "xbm": M.xbm_loss}[loss]
    miner = M.triplet_miner if loss == "triplet" else lambda: None
    bare = train(tmp_path, make(), miner=miner(), record=False)
    recorded = train(tmp_path, make(), miner=miner())
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(bare.state_dict().items(), recorded.state_dict().values()):
        assert torch.equal(a, b), name


def test_blank_record_normalised_to_a_zero_embedding(tmp_path):
    # record 9 all zeros: the bias-free trunk and embedder keep it 0, and the hand-written L2
    # normalisation divides 0 by its norm 0
    drawn = order(64, 3)
    at = drawn.index(9)
    rep = replayed(tmp_path, M.triplet_loss(), at // BATCH, "forward",
                   factory="make_normed_net", miner=M.ms_miner(), blank=9)
    assert outcome(rep) == (True, "invalid", "norm", "aten.div", [at % BATCH]), rep
    assert rep["origin"]["source"] == line_of("return x / x.norm(p=2, dim=1, keepdim=True)")


def test_nan_feature_of_a_record_is_the_input(tmp_path):
    drawn = order(64, 3)
    at = drawn.index(13)
    rep = replayed(tmp_path, M.triplet_loss(), at // BATCH, "input",
                   miner=M.triplet_miner(), nan_row=13)
    assert (rep["cause"], rep["origin"]["samples"]) == ("input", [at % BATCH]), rep
    assert "feature(s) 2" in rep["hint"], rep["hint"]


def test_supcon_temperature_far_too_small_overflows_exp(tmp_path):
    # sim / T = 1 / 0.005 = 200 on the diagonal: exp(200) is beyond float32's range
    rep = replayed(tmp_path, M.SupConLoss(temperature=0.005), 0, "loss")
    assert outcome(rep) == (True, "overflow", "<loss>", "aten.exp", list(range(BATCH))), rep
    assert rep["origin"]["source"] == line_of("exp = torch.exp(sim / self.temperature)")
    assert "subtract the row max" in rep["hint"], rep["hint"]


def test_ntxent_temperature_annealed_to_zero(tmp_path):
    # 0.07 * (1 - epoch / 2): 0 at the third epoch's first step, pml's pos_pairs / temperature
    rep = replayed(tmp_path, M.ntxent_loss(), 8, "loss", anneal=lambda e: 0.07 * (1 - e / 2))
    assert outcome(rep) == (True, "invalid", "<loss>", "aten.div", []), rep
    assert rep["origin"]["source"].endswith("pytorch_metric_learning/losses/ntxent_loss.py:24")
    assert "attribute temperature is 0" in rep["hint"], rep["hint"]


def test_ntxent_temperature_too_small_for_float16(tmp_path):
    # 1 / 1e-5 = 1e5, finite in float32 (pml subtracts the max before exp) but past float16's
    # 65504 under float16 autocast: pos_pairs / temperature overflows
    rep = replayed(tmp_path, M.ntxent_loss(1e-5), 0, "loss", fp16=True)
    assert outcome(rep) == (True, "overflow", "<loss>", "aten.div", []), rep
    assert rep["origin"]["source"].endswith("pytorch_metric_learning/losses/ntxent_loss.py:24")
    assert "beyond float16's largest value" in rep["hint"], rep["hint"]


def test_arcface_imprinted_under_bfloat16_rounds_cosines_to_one(tmp_path):
    # the class weights imprinted from class means: bfloat16 rounds the target cosines above
    # 0.998 to exactly 1, inside pml's clamp(-1, 1), where acos's derivative is infinite
    loss_fn = M.arcface_loss()
    model, ds = M.make_net(), M.Records(64)
    imprint(model, loss_fn, ds)
    first = order(64, 1)[:BATCH]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        cos = loss_fn.get_cosine(model(ds.x[first]))
    ones = (cos[torch.arange(BATCH), ds.labels[first]] == 1).nonzero().flatten().tolist()
    assert ones
    rep = replayed(tmp_path, M.arcface_loss(), 0, "backward", loss_lr=0.01, bf16=True,
                   imprinted=True)
    assert not rep["problems"], rep["problems"]  # the loss was rebuilt (its weight_init_func)
    assert outcome(rep) == (True, "precision", "<loss>", "AcosBackward0", ones), rep
    assert rep["origin"]["source"].endswith("losses/large_margin_softmax_loss.py:60")
    assert "installed package pytorch_metric_learning's, not the training code's" in rep[
        "hint"] and "torch.autocast(..., enabled=False)" in rep["hint"], rep["hint"]


def test_loss_optimizer_stepped_outside_the_grad_scaler(tmp_path):
    # float16 with a GradScaler: step 0's scaled gradients overflow and scaler.step(opt) skips
    # the model's update, but loss_optimizer.step() applies them to ArcFace's W: NaN at step 1
    rep = replayed(tmp_path, M.arcface_loss(), 1, "loss", loss_lr=0.01, fp16=True)
    assert outcome(rep) == (True, "weights", "<loss>", "aten.detach", []), rep
    assert rep["origin"]["source"].endswith("pytorch_metric_learning/losses/arcface_loss.py:26")
    assert "the GradScaler skipped step 0" in rep["hint"], rep["hint"]
    assert "scaler.step(loss_optimizer)" in rep["hint"], rep["hint"]
    # pml cast W to the float16 embeddings' type: the scaler would refuse to unscale it
    assert "but W is float16" in rep["hint"] and "embeddings.float()" in rep["hint"], rep["hint"]


def test_a_last_batch_of_one_record_has_no_positive(tmp_path):
    # 33 records in batches of 16 without the sampler: the last batch holds one record, which
    # has no positive, and the batch-hard loss averages over 0 valid anchors
    rep = replayed(tmp_path, M.BatchHardTriplet(), 2, "loss", n=33, sampler=False)
    assert outcome(rep) == (True, "invalid", "<loss>", "aten.div", []), rep
    assert rep["origin"]["source"] == line_of("return per_anchor.sum() / valid.sum()")
    assert "drop_last=True" in rep["hint"], rep["hint"]


def test_soft_nearest_neighbour_on_unstandardised_features_underflows(tmp_path):
    # features 10x their scale: squared distances in the hundreds, exp(-d / 0.1) is 0 for
    # every other record of record 7, and its ratio 0 / 0
    rep = replayed(tmp_path, M.SoftNearestNeighbour(0.1), 0, "loss", scale=10.0)
    assert outcome(rep) == (True, "underflow", "<loss>", "aten.div", [7]), rep
    assert rep["origin"]["source"] == line_of(
        "return -torch.log((sim * same).sum(1) / sim.sum(1)).mean()")
    assert "compute in log space" in rep["hint"], rep["hint"]


def test_loss_holding_an_init_wrapper_is_rebuilt():
    # pml's ArcFaceLoss keeps weight_init_func, a TorchInitWrapper of torch.nn.init.normal_:
    # a plain object of an importable class, described by its class and attributes
    from recorder.lossdesc import describe_loss
    from replay.losses import rebuild_loss

    tensors: dict = {}
    info = describe_loss(losses.ArcFaceLoss(num_classes=3, embedding_size=5), tensors)
    assert info["tree"]["unrecorded"] == [], info["tree"]["unrecorded"]
    rebuilt = rebuild_loss(info, tensors, torch.device("cpu"))
    init = rebuilt.weight_init_func
    assert type(init).__name__ == "TorchInitWrapper" and init.init_func is torch.nn.init.normal_
    assert torch.equal(rebuilt.W, tensors["loss/W"])
