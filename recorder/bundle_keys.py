"""What a bundle is read into (its metadata's JSON objects, its tensors by name) answers a key it
lacks with :class:`MissingEntry`: a :class:`BundleError` (one line from ``nanreplay``, naming the
key) that is still a ``KeyError`` for the code that tries a key and falls back. A damaged or
hand-edited bundle without a key the replay reads (a renamed tensor, an optimizer without its
``param_groups``) otherwise ended in a raw ``KeyError`` deep in the replay."""

from __future__ import annotations

from typing import Any

from .errors import BundleError

_FIX = "the file is corrupted or was not written by the recorder; pass the bundle it wrote"


class MissingEntry(BundleError, KeyError):
    """A key the reader looked up that the bundle does not hold."""

    def __str__(self) -> str:  # (KeyError's would quote the whole message)
        return str(self.args[0])


class Metadata(dict):
    """A JSON object of the bundle's metadata (``json.loads``' ``object_hook``)."""

    def __missing__(self, key: Any) -> Any:
        raise MissingEntry(f"the bundle's metadata lacks {str(key)[:80]!r}, which the replay "
                           f"reads; {_FIX}")


class Tensors(dict):
    """The bundle's tensors by name."""

    def __missing__(self, key: Any) -> Any:
        raise MissingEntry(f"the bundle holds no tensor {str(key)[:80]!r}, which its metadata "
                           f"names; {_FIX}")
