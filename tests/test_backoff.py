"""common/backoff.py in closed form: the waits between retries, with the random factor pinned."""

from __future__ import annotations

import pytest

from streamdiloco.common.backoff import Backoff


def test_each_wait_doubles_up_to_the_most_and_a_reset_starts_over():
    low = Backoff(first=0.5, most=8.0, rand=lambda a, b: a)  # the factor at its least: 0.5
    assert [low.next() for _ in range(7)] == [0.25, 0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    low.reset()
    assert low.next() == 0.25
    high = Backoff(first=0.5, most=8.0, rand=lambda a, b: b)  # at its most: 1
    assert [high.next() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]


def test_the_random_factor_spreads_the_waits_within_half_to_whole():
    b = Backoff(first=2.0, most=2.0)
    waits = [b.next() for _ in range(200)]
    assert all(1.0 <= w <= 2.0 for w in waits) and len(set(waits)) > 100


def test_a_backoff_that_cannot_wait_is_refused():
    with pytest.raises(ValueError, match="need 0 < first <= most"):
        Backoff(first=0, most=8)
    with pytest.raises(ValueError, match="need 0 < first <= most"):
        Backoff(first=9, most=8)
