"""One attached FlightRecorder per model.

A notebook cell run again builds a second recorder on the same model while the first, no
longer reachable from the notebook (its variable now holds the second), stays attached: two
sets of hooks, two host reads a step, two bundles of one event, and a recorder the user can no
longer detach. Attaching a recorder to a model another one records detaches that one, with a
warning that says so.

A recorder whose own ``with`` block is still open is different: the code around it counts on
it (two nested ``with FlightRecorder(model, ...)`` blocks, or a Trainer callback's recorder
attached inside one), and detaching it would leave the rest of that block unrecorded with no
word at its end but a misleading "saw no forward". The second recorder is refused instead, in
one line, before it registers anything.
"""

from __future__ import annotations

import warnings
import weakref

from torch import nn

# the model -> its attached recorder (weak both ways: neither is kept alive by this)
_ATTACHED: weakref.WeakKeyDictionary[nn.Module, weakref.ref] = weakref.WeakKeyDictionary()
# the attached recorders that their own `with` statement attached (until they detach)
_IN_WITH: weakref.WeakSet = weakref.WeakSet()


def take_over(model: nn.Module | None, recorder, in_with: bool = False) -> None:
    """Make ``recorder`` the one recording ``model``: detach the one attached before."""
    if model is None:
        return
    old = (ref := _ATTACHED.get(model)) and ref()
    if old is not None and old is not recorder and old in _IN_WITH:
        raise ValueError(
            f"FlightRecorder: {type(model).__name__} is already recorded by a FlightRecorder "
            f"whose `with` block is still open (out_dir '{old.settings.out_dir}'); one recorder "
            "records a model at a time: leave out this one (or the outer one), or attach it "
            "after that block ends")
    if old is not None and old is not recorder:
        warnings.warn(
            f"nanreplay: {type(model).__name__} already had a FlightRecorder attached (a "
            "notebook cell run again, or a recorder not detached); it is detached now so one "
            "recorder records the model: use `with FlightRecorder(...)` or call "
            "recorder.detach() when done", stacklevel=4)
        old.detach()
    _ATTACHED[model] = weakref.ref(recorder)
    if in_with:  # (attached by its own ``with`` statement)
        _IN_WITH.add(recorder)


def let_go(model: nn.Module | None, recorder) -> None:
    """``recorder`` detached: ``model`` has no recorder attached."""
    if model is not None and (ref := _ATTACHED.get(model)) is not None and ref() is recorder:
        del _ATTACHED[model]
    _IN_WITH.discard(recorder)
