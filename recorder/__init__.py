"""nanreplay's flight recorder: per-layer statistics on the device, guards, and ``.nan`` bundles.

>>> from recorder import FlightRecorder, NonFiniteError      # doctest: +SKIP
>>> with FlightRecorder(model, optimizer, loss_fn=criterion, out_dir="nan-bundles"):
...     train()   # raises NonFiniteError(bundle_path=...) at the first NaN/Inf
"""

from .errors import BundleError, NonFiniteError
from .flight import FlightRecorder

__all__ = ["FlightRecorder", "NonFiniteError", "BundleError"]
