"""The bisection's documented bound, checked on the search itself: ``Runner.bisect`` finds the
first non-finite call among ``n`` in at most ``ceil(log2 n)`` probes, for every ``n`` and every
position of that call, and the bound is tight (some position needs all of them). The replay
adds one run to find the origin call, hence the report's ``limit`` of ``ceil(log2 n) + 1``
(``tests/test_replay_e2e.py`` checks that on real re-runs)."""

from __future__ import annotations

import math

import pytest

from replay.rerun import Runner


class FakeRunner:
    """A runner whose probe answers from a known first bad call, counting the probes."""

    allowed: set[str] = set()

    def __init__(self, first_bad: int):
        self.first_bad = first_bad
        self.probes = 0

    def probe(self, k: int, allowed) -> bool:
        self.probes += 1
        return k >= self.first_bad


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 9, 100, 257])
def test_bisect_finds_every_position_within_ceil_log2_probes(n):
    worst = 0
    for first_bad in range(n):
        fake = FakeRunner(first_bad)
        found, probes = Runner.bisect(fake, n)
        assert (found, probes) == (first_bad, fake.probes)
        worst = max(worst, probes)
    assert worst == math.ceil(math.log2(n))


def test_bisect_of_no_calls_runs_nothing():
    fake = FakeRunner(0)
    assert Runner.bisect(fake, 0) == (None, 0) and fake.probes == 0
