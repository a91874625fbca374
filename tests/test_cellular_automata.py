"""End to end on neural cellular automata (``cellular_automata_models``): the Growing NCA
(fixed Sobel filters as a buffer, a zero-initialised last layer, stochastic per-cell update
masks from ``torch.rand``, alive masking by max-pool, 32-96 CA steps unrolled per training
step, the number of steps given to ``forward``) trained from a sample pool with the worst
sample replaced by the seed, damage cut into the others, and the per-parameter gradient
normalisation before Adam; and the texture NCA under a Gram-matrix style loss. Each planted
bug of the domain fires under the recorder and is replayed with the CLI; the healthy runs raise
no event and train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import cellular_automata_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("cellular_automata_models.py", text)


def train_growing(make: str, out_dir, *, steps: int = 3, ca_steps: int = 32, eps: float = 1e-8,
                  pool_size: int = 8, lr: float = 2e-3, record: bool = True,
                  crit: torch.nn.Module | None = None, central_damage: bool = False):
    """The Growing NCA notebook's loop: a batch drawn from the pool, sorted by loss, its worst
    sample replaced by the seed and its best one damaged; the gradient of each parameter
    divided by its norm before Adam; the batch written back into the pool. Returns the
    model and the pool."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [2000], 0.1)
    crit, target = crit or M.PixelLoss(), M.target_image()
    pool = M.seed_state(pool_size)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)  # (the stochastic update masks)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"cellular_automata_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            idx = torch.randint(pool_size, (4,), generator=g)
            order = M.per_sample_loss(pool[idx], target).argsort(descending=True)
            idx = idx[order]
            x0 = pool[idx]
            x0[:1] = M.seed_state(1)
            x0[-1:] *= M.damage_mask(1, 16, g, central_damage and step == steps - 1)
            x = model(x0, ca_steps)
            extra = (model.alive(x).float(),) if isinstance(crit, M.AliveLoss) else ()
            loss = loss_fn(x, target, *extra)
            opt.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p.grad /= p.grad.norm() + eps if eps else p.grad.norm()
            opt.step()
            sched.step()
            pool[idx] = x.detach()
    return model, pool


def test_gradient_normalisation_without_eps_names_the_zero_gradient_of_the_zero_init(tmp_path):
    """The notebook's ``p.grad /= p.grad.norm() + 1e-8`` with the eps dropped: the update
    rule's last layer starts at zero, so no gradient reaches the first layer at step 0 and its
    norm is 0; the loop's division makes every element NaN before Adam. The recorder stops
    at the update; the replay's backward cannot make that NaN (the loop did) but shows the
    gradient was exactly 0 and names the zero-initialised layer and the eps."""
    with pytest.raises(NonFiniteError) as info:
        train_growing("make_growing", tmp_path, eps=0.0)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["kind"], ev["params"]) == (
        0, "backward", "nan", ["w1.weight", "w1.bias"]), ev
    rep = nanreplay_json(info.value.bundle_path, code=1)  # (1: the loop's code made it)
    o = rep["origin"]
    assert (o["phase"], o["param"], rep["reproduced"], rep["cause"]) == (
        "backward", "w1.weight", False, "invalid"), rep
    hint = rep["hint"]
    assert "gradient of w1.weight, w1.bias exactly 0 in every element" in hint, hint
    assert "w2.weight is all 0 in the bundle" in hint and "g.norm() + eps" not in hint, hint
    assert "X / (X.norm() + eps)" in hint, hint


@pytest.mark.parametrize("make", ["make_growing", "make_growing_seeded"])
def test_healthy_growing_ca_raises_nothing_and_trains_the_same(tmp_path, make):
    """The notebook's loop as written (eps kept): no event over the pool, damage and the
    stochastic updates (from the global RNG, or the model's own generator, which the
    recorder reads at each step), and weights and pool bit-identical with and without the
    recorder."""
    model, pool = train_growing(make, tmp_path, steps=4)
    plain, plain_pool = train_growing(make, tmp_path, steps=4, record=False)
    assert not list(tmp_path.glob("*.nan"))
    assert torch.equal(pool, plain_pool)
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


UNMASKED = {"steps": 8, "ca_steps": 96, "pool_size": 4, "lr": 1e-4}


def test_unmasked_pool_state_that_grew_over_training_steps_overflows_the_loss(tmp_path):
    """No alive mask and no zero init: every cell is updated at every CA step and the state
    grows about 15% a step. The pool feeds each sample's state back into the next training
    step, so after a few of them a pool sample has been iterated hundreds of times and its
    squared error in the loss overflows. The replay names the pow on the loss's line, the
    pool sample's row, overflow, that the run was diverging, and that the row is the pool's
    state grown over the steps before (its input absmax jumped a step earlier), no corrupt
    record to drop."""
    with pytest.raises(NonFiniteError) as info:
        train_growing("make_growing_unmasked", tmp_path, **UNMASKED)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (4, "loss", "<loss>", "+inf"), ev
    batch = read_bundle(info.value.bundle_path)[1]["batch/0/0"]  # (the pool rows fed in)
    grown = batch.flatten(1).abs().amax(1)
    assert grown.argmax().item() == 1 and grown[1] > 1e15, grown  # (squared: past 3.4e38)
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == (
        "loss", "<loss>", "aten.pow", [1], "overflow"), rep
    assert o["source"] == line_of("return (x[:, :4] - target).pow(2).mean(dim=(1, 2, 3))"), o
    hint = rep["hint"]
    assert "diverging" in hint and "a state the loop feeds back" in hint, hint
    assert "alive mask" in hint and "corrupt record" not in hint, hint  # (no data to drop)


def train_texture(out_dir, *, black: int | None = None, normalise: bool = True,
                  steps: int = 4, record: bool = True, caffe: bool = False):
    """Self-Organising Textures: a pool of small random states, 24 CA steps, the Gram loss of
    frozen VGG-like features, the gradient normalisation, Adam with gradient accumulation
    over two half-batches; ``black``: a pool sample of the last step gone black (RGB 0)."""
    model = M.make_texture()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = M.GramLoss(M.stripes(), normalise=normalise, caffe=caffe)
    scaler = torch.amp.GradScaler("cpu", enabled=caffe)  # (float16 autocast with it)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)
    pool = torch.rand(8, 12, 16, 16, generator=g) * 0.2 - 0.1
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory="cellular_automata_models:make_texture") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            idx = torch.randint(8, (4,), generator=g)
            x0 = pool[idx]
            if black is not None and step == steps - 1:
                x0[black, :3] = -0.5
            opt.zero_grad()
            for half in (x0[:2], x0[2:]):
                with torch.autocast("cpu", dtype=torch.float16, enabled=caffe):
                    loss = loss_fn(model(half, 24)) / 2
                scaler.scale(loss).backward()
            scaler.unscale_(opt)
            with torch.no_grad():
                for p in model.parameters():
                    p.grad /= p.grad.norm() + 1e-8
            scaler.step(opt)
            scaler.update()
    return model


def test_trace_normalised_gram_of_a_black_sample_names_the_division_and_the_sample(tmp_path):
    """A scale-invariant style loss divides each Gram matrix by its trace; a pool sample gone
    black leaves every feature map of the frozen VGG dead (ReLU of negative biases), the
    trace is 0 and the Gram 0/0. A loss event of the second half-batch, named at the
    division on its line, on that sample (row 1 of the micro-batch), invalid 0/0 with the eps
    advice."""
    with pytest.raises(NonFiniteError) as info:
        train_texture(tmp_path, black=3)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["micro_batch"]) == (3, "loss", 1), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], o["micro_batch"]) == (
        "<loss>", "aten.div", "nan", [1], 1), o
    assert o["source"] == line_of("g = g / g.diagonal(dim1=1, dim2=2).sum(-1)"), o
    assert rep["cause"] == "invalid" and "add an eps to the denominator" in rep["hint"], rep


def test_healthy_texture_ca_raises_nothing_and_trains_the_same(tmp_path):
    """The plain Gram loss (no trace division) on the same black sample: dead feature maps
    give a zero Gram, no NaN; no event, and bit-identical weights with and without the
    recorder (accumulation over half-batches, the stochastic update masks)."""
    recorded = train_texture(tmp_path, black=3, normalise=False)
    plain = train_texture(tmp_path, black=3, normalise=False, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_alive_normalised_loss_of_a_pattern_damage_killed_names_the_division_and_sample(
        tmp_path):
    """An MSE over the living cells divided by each sample's count of them: the damage of
    the last step cuts its circle over the young pattern's centre, every cell of that sample
    dies (the alive mask of its output is all 0) and its term is 0/0. The update masks come
    from the model's own ``torch.Generator``, which the replay restores: the event is
    reproduced, named at the division on its line, on the damaged sample (the batch's last
    row), and dropping it makes the step finite."""
    with pytest.raises(NonFiniteError) as info:
        train_growing("make_growing_seeded", tmp_path, crit=M.AliveLoss(), central_damage=True)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (2, "loss", "<loss>", "nan")
    rep = nanreplay_json(info.value.bundle_path, "--try", "drop=3")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "<loss>", "aten.div", "nan", [3]), o
    assert o["source"] == line_of("per_sample = err.sum(dim=(1, 2, 3)) / alive.sum("), o
    assert rep["cause"] == "invalid" and "skip the rows where it is 0" in rep["hint"], rep
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_gram_of_caffe_scaled_features_under_float16_autocast_names_the_bmm(tmp_path):
    """Caffe's VGG weights take 0-255 images, so the features are in the tens and the Gram's
    sum over the pixels (einsum, a bmm under autocast) passes float16's 65504 before its
    division by h * w: an overflow at step 0 in the loss of the first half-batch, on both
    its rows, with the advice to compute that op in float32 or rescale its inputs."""
    with pytest.raises(NonFiniteError) as info:
        train_texture(tmp_path, normalise=False, caffe=True)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["micro_batch"], ev["kind"]) == (0, "loss", 0, "+inf")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], o["dtype"], rep["cause"]) == (
        "<loss>", "aten.bmm", [0, 1], "float16", "overflow"), rep
    assert o["source"] == line_of('g = torch.einsum("bci,bdi->bcd", f, f) / (h * w)'), o
    assert "compute this op in float32" in rep["hint"], rep["hint"]
