"""The Python API (``replay.replay``, ``replay.bundle_info``, ``replay.strip_bundle``): what
the ``nanreplay`` command does, for a notebook or a script. Its arguments are checked before
anything runs, as the command's options are; its errors are the product's one-line
``ReplayError`` / ``BundleError``, in the words of its own arguments (``factory=``, not
``--factory MOD:FN``: :mod:`replay.api_words`), never a traceback from inside the replay
(``debug=True`` lets one through, as ``--debug`` prints it)."""

from __future__ import annotations

import contextlib
import copy
import os
from pathlib import Path
from typing import Any

from recorder.errors import BundleError

from .api_words import in_python_words, python_words
from .bundle_dir import bundle_path
from .errors import ReplayError, one_line

DEVICES = ("cpu", "cuda")
STRIP_PARTS = ("batch", "weights")


def replay(path, *, factory=None, device=None, factory_kwargs: dict | None = None,
           tries=None, html=None, debug: bool = False) -> dict[str, Any]:
    """The report for one bundle (a ``.nan`` file, or the run's out_dir holding one event's),
    as ``nanreplay --json`` prints it, plus ``history``; ``html``: also write the HTML page
    there; ``debug``: let an internal error's traceback through."""
    with _own_errors(debug):
        path = _bundle(path)
        _check_factory(factory, factory_kwargs)
        device = _device(device)
        tries = _tries(tries)
        html = _html_path(html)
        from .analyze import analyze_bundle
        from .failed_stage import show_tracebacks

        show_tracebacks(debug)  # (a failed stage's traceback on stderr, as --debug prints it)
        try:
            report = analyze_bundle(path, factory, device, factory_kwargs, tries)
        finally:
            show_tracebacks(False)
        in_python_words(report)
        if html is not None:
            _write_html(report, html)
        return report


def bundle_info(path) -> dict[str, Any]:
    """What the bundle holds, read from its header (``nanreplay --info --json``): nothing is
    imported or re-run."""
    with _own_errors(False):
        from .info import info

        return info(_bundle(path))


def strip_bundle(path, output, parts=STRIP_PARTS) -> list[Path]:
    """A shareable copy of the bundle at ``output`` without ``parts`` ("batch", "weights"),
    as ``nanreplay PATH --strip batch -o OUTPUT`` writes it; the paths written."""
    with _own_errors(False):
        parts = [parts] if isinstance(parts, str) else list(parts)
        if not parts or any(p not in STRIP_PARTS for p in parts):
            raise ReplayError(f"parts={parts!r}: strip_bundle removes 'batch' and/or "
                              "'weights'; pass e.g. parts=['batch']")
        output = Path(_path(output, "output"))
        from .strip import strip_set

        try:
            return strip_set(_bundle(path), output, parts)
        except OSError as e:  # (reading errors are BundleErrors: this is the copy's path)
            from recorder.validate import why_unwritable

            raise ReplayError(f"cannot write {output} ({why_unwritable(output.parent, e)}); "
                              "pass another output path") from None


def report_text(report: dict[str, Any]) -> str:
    """The report as ``nanreplay`` prints it."""
    from .report import to_text

    return to_text(report)


def report_json(report: dict[str, Any]) -> str:
    """The report as ``nanreplay --json`` prints it (without ``history``)."""
    from .info import to_json

    return to_json(report)


@contextlib.contextmanager
def _own_errors(debug: bool):
    """The product's errors in the API's words; any other as one ``ReplayError`` line (its
    traceback with ``debug=True``), as the command line's ``replay failed`` says it."""
    try:
        yield
    except (BundleError, ReplayError) as e:
        said = copy.copy(e)  # (a new one: contextlib gives a re-raised one its traceback back)
        said.args = (python_words(str(e)),)
        raise said.with_traceback(None) from None
    except Exception as e:
        if debug:
            raise
        raise ReplayError(f"replay failed ({type(e).__name__}: {one_line(e)}); re-run with "
                          "debug=True for the traceback") from None


def _path(value, what: str) -> str | os.PathLike:
    if not isinstance(value, (str, os.PathLike)):
        raise ReplayError(f"{what}={value!r} is not a path; pass the path as a str or Path")
    return value


def _bundle(path) -> Path:
    path = Path(_path(path, "path"))
    if not path.exists():
        raise BundleError(f"{path}: no such file or directory; pass the path of the .nan file "
                          "the recorder wrote, or its out_dir")
    return bundle_path(path)


def _check_factory(factory, factory_kwargs) -> None:
    if factory is not None and not isinstance(factory, str) and not callable(factory):
        raise ReplayError(f"factory={factory!r} is neither a function nor a class; pass the "
                          "function (or model class) that builds the model, or \"MOD:FN\"")
    if factory_kwargs is not None and not (isinstance(factory_kwargs, dict) and all(
            isinstance(k, str) and k.isidentifier() for k in factory_kwargs)):
        raise ReplayError(f"factory_kwargs={str(factory_kwargs)[:80]} is not a dict of keyword "
                          "arguments for the factory; pass e.g. factory_kwargs={'width': 8}")


def _device(device) -> str | None:
    """``device``: None (the recorded one), ``"cpu"``, ``"cuda"`` (``"cuda:1"``) or a
    ``torch.device`` of those."""
    if device is None:
        return None
    import torch

    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        d = None
    if d is None or d.type not in DEVICES:
        raise ReplayError(f"device={device!r} is not a device the replay runs on; pass "
                          "device=\"cpu\" or device=\"cuda\"")
    return str(d)


def _tries(tries) -> list[str]:
    """``tries``: a list of what-ifs (one string is one what-if), each checked now."""
    if tries is None:
        return []
    tries = [tries] if isinstance(tries, str) else tries
    if not isinstance(tries, (list, tuple)) or not all(isinstance(t, str) for t in tries):
        raise ReplayError(f"tries={str(tries)[:80]} is not a list of what-ifs; pass e.g. "
                          "tries=[\"lr=0.1x\", \"auto\"]")
    from .whatif import TryError, parse_try

    for t in tries:
        try:
            parse_try(t)
        except TryError as e:
            raise ReplayError(str(e)) from None
    return list(tries)


def _html_path(html) -> Path | None:
    """The page's path, its directory checked before the replay (which can take minutes)."""
    if html is None:
        return None
    html = Path(_path(html, "html"))
    if not html.parent.is_dir():
        why = "is a file, not a directory" if html.parent.exists() else "does not exist"
        raise ReplayError(f"cannot write the HTML report to {html} ({html.parent} {why}); "
                          "pass an html= path in an existing directory")
    return html


def _write_html(report: dict[str, Any], html: Path) -> None:
    from .html import render_html

    try:
        html.write_text(render_html(report, report["history"]), encoding="utf-8")
    except OSError as e:
        raise ReplayError(f"cannot write the HTML report to {html} ({e.strerror or e}); "
                          "pass another html= path") from None
