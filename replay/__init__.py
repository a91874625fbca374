"""nanreplay's replayer: re-runs the step in a ``.nan`` bundle and names the op, module,
samples and cause of its first non-finite value. The command line is ``nanreplay``.

>>> from replay import replay                                  # doctest: +SKIP
>>> report = replay("nan-bundles/step00000006-rank0.nan")
>>> report["origin"]["op"], report["cause"]
('aten.log', 'invalid')
"""

from __future__ import annotations

from .errors import ReplayError


def replay(path, *, factory: str | None = None, device: str | None = None,
           factory_kwargs: dict | None = None) -> dict:
    """The report for one bundle, as ``nanreplay --json`` prints it (plus ``history``);
    ``factory_kwargs`` replace the recorded ones."""
    from .analyze import analyze
    from .errors import FactoryRefused
    from .load import build, read_step

    step = read_step(path)
    try:
        build(step, factory, device, factory_kwargs)
    except FactoryRefused as e:
        step.problems.append(str(e))
    return analyze(step)


__all__ = ["replay", "ReplayError"]
