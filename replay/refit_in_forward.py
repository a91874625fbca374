"""Trained parameters the model's own forward writes through ``.data`` (efficient-kan's grid
update refits its spline coefficients in place, ``self.spline_weight.data.copy_(lstsq(...))``,
inside the forward that passes ``update_grid=True``). A write through ``.data`` bumps no
version, so neither the recorder (``written_in_step``) nor the re-run's reset sees it: each
re-run starts from the coefficients the one before wrote, and two re-runs disagree, which
reads as nondeterminism. Found by value after the first re-run and put back before each later
one (:meth:`replay.rerun.Runner.run_twice`; the bundle holds them as that step's forward left
them)."""

from __future__ import annotations

import torch
from torch import nn


def trained_copies(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the model's trained parameters, as a run begins."""
    return {n: p.detach().clone() for n, p in model.named_parameters()
            if p.requires_grad and _plain(p)}


def written_since(model: nn.Module, before: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Those of ``before`` whose values the run changed in place, as they were."""
    return {n: first for n, p in model.named_parameters()
            if (first := before.get(n)) is not None and _plain(p) and _changed(first, p)}


def written_note(written: dict[str, torch.Tensor], model: nn.Module) -> str:
    more = f" +{len(written) - 4} more" if len(written) > 4 else ""
    renormed = [f"{n.rpartition('.')[0] or '<root>'}' (max_norm={m.max_norm})"
                for n in written if isinstance(m := _owner(model, n), nn.Embedding)
                and m.max_norm is not None]
    how = (f"nn.Embedding '{renormed[0]} renormalises the rows it looks up in place"
           if renormed else "through .data (a refit in place, a grid update)")
    return (f"the model's forward writes its trained parameters ({', '.join(list(written)[:4])}"
            f"{more}) itself, {how}: the bundle holds them as this step's forward left them, "
            "and each re-run starts from those")


def _owner(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name.rpartition(".")[0])
    except AttributeError:
        return None


def _plain(p: torch.Tensor) -> bool:
    """A dense tensor with values here (not a meta placeholder: a hypernetwork's target)."""
    return not p.is_meta and p.layout == torch.strided and type(p.data) is torch.Tensor


def _changed(first: torch.Tensor, p: torch.Tensor) -> bool:
    """Written in place, values only (a parameter replaced by another shape is not this)."""
    return first.shape == p.shape and first.dtype == p.dtype and first.device == p.device \
        and not torch.equal(first.nan_to_num(), p.detach().nan_to_num())
