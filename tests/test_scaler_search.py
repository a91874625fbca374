"""The search for a GradScaler the recorder was not given (``recorder.scalers``) runs at each
backward event; after one that found none it is skipped while nothing that could make a scaler
happened (each scaler class's reference count and the imported modules unchanged): it walked
every class and the whole heap, 0.2 s an event in a large process. These are the ways a scaler
appears after such a search; each must be found."""

from __future__ import annotations

import torch

from recorder import scalers


def _scale_a_loss(scaler) -> None:
    w = torch.ones(2, requires_grad=True)
    scaler.scale((w * 2).sum())


def test_a_scaler_made_after_a_search_that_found_none_is_found():
    assert scalers.unregistered_scalers() == []
    assert scalers.unregistered_scalers() == []  # (the second from the kept state)
    scaler = torch.amp.GradScaler("cpu")
    _scale_a_loss(scaler)
    assert scalers.unregistered_scalers() == [scaler]
    del scaler
    assert scalers.unregistered_scalers() == []


def test_a_scaler_that_scales_only_after_the_search_is_found():
    """Made before a search, unused then (no scale yet: not in use), and used after."""
    scaler = torch.amp.GradScaler("cpu")
    assert scalers.unregistered_scalers() == []
    _scale_a_loss(scaler)
    assert scalers.unregistered_scalers() == [scaler]


def test_a_subclass_defined_after_a_search_is_found():
    assert scalers.unregistered_scalers() == []

    class MyGradScaler(torch.amp.GradScaler):
        pass

    scaler = MyGradScaler("cpu")
    _scale_a_loss(scaler)
    assert scalers.unregistered_scalers() == [scaler]
