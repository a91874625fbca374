"""A GAN loop recorded on its discriminator: the generator's loss runs ``disc(fake)`` after
``d_opt.step()``, so that forward opens the discriminator's next step as micro-batch 0, and
the loop's ``d_opt.zero_grad()`` drops its gradients before the discriminator's own two
forwards. The replay summed all three micro-batches' gradients: a rewind window's updates
were not training's, and it explained the larger norm as 'the loop's gradient clipping to norm
0.26 re-applied', a clip this loop never had."""

from __future__ import annotations

from pathlib import Path

import gan_models as G
import pytest
import torch
import torch.nn.functional as F
from bundles import invoke_cli

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle
from replay import replay

BAD_STEP, BAD_ROW = 6, 3


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def train_gan(out_dir: Path) -> NonFiniteError:
    torch.manual_seed(0)
    gen, disc = G.make_gen(), G.make_disc()
    g_opt = torch.optim.Adam(gen.parameters(), 2e-4, betas=(0.5, 0.999))
    d_opt = torch.optim.Adam(disc.parameters(), 2e-4, betas=(0.5, 0.999))
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(disc, d_opt, out_dir=out_dir, rewind=2,
                            factory="gan_models:make_disc"):
            for step in range(10):
                real = G.real_batch(step)
                if step == BAD_STEP:
                    real[BAD_ROW, 2] = float("nan")  # a corrupt record
                fake = gen(torch.randn(len(real), G.Z))
                ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
                d_opt.zero_grad()
                d_loss = F.binary_cross_entropy_with_logits(disc(real), ones) + \
                    F.binary_cross_entropy_with_logits(disc(fake.detach()), zeros)
                d_loss.backward()
                d_opt.step()
                g_opt.zero_grad()
                F.binary_cross_entropy_with_logits(disc(fake), ones).backward()
                g_opt.step()
    return info.value


def test_gradients_the_loop_dropped_are_dropped_in_the_replay(tmp_path):
    err = train_gan(tmp_path)
    ev = err.event
    assert (ev["step"], ev["phase"], ev["micro_batch"], ev["samples"]) == \
        (BAD_STEP, "input", 1, [BAD_ROW])
    meta, tensors = read_bundle(err.bundle_path)
    # micro-batch 0 is the generator's pass, whose gradients d_opt.zero_grad() dropped
    assert [mb.get("grads_dropped", False) for mb in meta["micro_batches"]] == \
        [False, True, False]
    rep = replay(err.bundle_path)
    assert rep["reproduced"] and rep["cause"] == "input"
    assert rep["origin"]["samples"] == [BAD_ROW]
    w = rep["window"]
    assert w["reproduced"] and w["loop_clip"] is None
    # each re-run update used the gradients training's did
    steps, norms = tensors["ring/steps"].tolist(), tensors["ring/grad_norm"].tolist()
    recorded = dict(zip(steps, norms))
    for s in w["per_step"][:-1]:
        assert s["grad_norm"] == pytest.approx(recorded[s["step"]], rel=1e-4), s
    res = invoke_cli(err.bundle_path)
    assert res.exit_code == 0 and "clipping" not in res.stdout, res.stdout
