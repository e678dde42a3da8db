"""`flywheel.lru.LRU`, the one bounded map: least recently used forgotten first, reads count as use."""

import pytest

from flywheel.lru import LRU


def test_the_least_recently_used_entry_goes_first():
    lru: LRU[str, int] = LRU(2)
    lru["a"], lru["b"] = 1, 2
    assert lru.get("a") == 1  # a read makes "a" recent: "b" is now the oldest
    lru["c"] = 3
    assert list(lru) == ["a", "c"] and "b" not in lru
    lru["a"] = 10  # a write too
    lru["d"] = 4
    assert list(lru) == ["a", "d"] and lru.peek("a") == 10


def test_peek_and_membership_do_not_count_as_use():
    lru: LRU[str, int] = LRU(2)
    lru["a"], lru["b"] = 1, 2
    assert "a" in lru and lru.peek("a") == 1
    lru["c"] = 3
    assert "a" not in lru and len(lru) == 2


def test_capacity_zero_keeps_nothing():
    off: LRU[str, int] = LRU(0)
    off["a"] = 1
    assert len(off) == 0 and off.get("a", -1) == -1


def test_a_negative_capacity_is_refused():
    with pytest.raises(ValueError, match="at least 0"):
        LRU(-1)
