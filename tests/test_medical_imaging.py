"""3D medical imaging trained as that community writes it (``medical_imaging_models.py``): a 3D
U-Net on random patches cropped inside the Dataset in DataLoader workers, Dice-family losses
over one-hot labels, VoxelMorph-style registration under bfloat16 autocast, with a planted
bug: the recorder fires at the planted step and ``nanreplay --json`` names the op, samples,
cause and fix."""

from __future__ import annotations

import json
from pathlib import Path

import medical_imaging_models as M
import pytest
import torch
from bundles import nanreplay_json
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError

HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
def _from_tests_dir(monkeypatch):
    monkeypatch.chdir(HERE)  # where medical_imaging_models.py, the factories' module, lives


@pytest.mark.parametrize("batch_dice", [True, False])
def test_a_batch_dice_weight_of_a_class_absent_from_the_batch_names_no_sample(out_dir,
                                                                             batch_dice):
    """Binary segmentation (background + lesion, two classes) in batches of two patches, the
    generalized Dice weighting each class by 1 / volume² without MONAI's guard; batch 1's
    scans hold no lesion. Summed over the batch (``batch=True``, MONAI's option) the weights
    are one per class, shape (2,): the lesion's +inf was named as sample [1] (its class
    index, read as a row of a batch of 2) and ``--try auto`` dropped that sample, which
    changed nothing. A value pooled over the batch names no sample now; the per-sample
    weights (B, C) still name both patches."""
    vols, labs = M.phantom(4, size=16)
    labs = (labs > 0).long()
    labs[2:] = 0
    vols[2:] = 0.1 * torch.randn(vols[2:].shape)
    model = M.make_unet(n_classes=2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = M.GeneralizedDiceLoss(batch=batch_dice)
    torch.manual_seed(0)
    loader = DataLoader(M.RandomPatches(vols, labs, patch=12), batch_size=2, num_workers=2)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="medical_imaging_models:make_unet",
                            factory_kwargs={"n_classes": 2}):
            for vol, lab in loader:
                opt.zero_grad()
                crit(model(vol), lab).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (1, "loss", "<loss>"), ev
    rep = nanreplay_json(info.value.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (o["op"], o["made"], rep["cause"]) == ("aten.reciprocal", "+inf", "invalid"), \
        json.dumps(rep, indent=1)
    assert o["samples"] == ([] if batch_dice else [0, 1]), o
    assert not any(t["try"].startswith("drop=") for t in rep["what_if"]), rep["what_if"]
