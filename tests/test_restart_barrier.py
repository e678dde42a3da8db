"""The restart barrier (flywheel/bus/restart_barrier.py): a consumer whose predecessor died holding
records holds what it receives until those are back, then releases everything in stream order,
each record once."""

from types import SimpleNamespace

from flywheel.bus import Delivery
from flywheel.bus.restart_barrier import RestartBarrier


def delivery(seq: int, tag: str = "") -> Delivery:
    return Delivery(record=SimpleNamespace(tag=tag), msg=SimpleNamespace(metadata=SimpleNamespace(
        sequence=SimpleNamespace(stream=seq))))


def test_newer_records_wait_for_the_predecessors_and_each_comes_out_once_in_order():
    barrier = RestartBarrier(outstanding=2, last_delivered=2, ack_wait_s=30.0, clock=lambda: 0.0)
    assert barrier.hold([delivery(3), delivery(4)]) is None  # newer ones first: held
    assert barrier.hold([delivery(1)]) is None
    # The other outstanding one, with the first again (its ack wait ran out while it was held).
    released = barrier.hold([delivery(2), delivery(1, "again")])
    assert [d.stream_seq for d in released] == [1, 2, 3, 4] and released[0].record.tag == "again"
    later = [delivery(6), delivery(5)]  # open now: fetches go through as they come, nothing held
    assert barrier.open and barrier.hold(later) is later and barrier.held == []


def test_records_that_never_come_back_are_waited_for_twice_the_ack_wait_and_no_longer():
    now = [0.0]
    barrier = RestartBarrier(outstanding=1, last_delivered=5, ack_wait_s=10.0, clock=lambda: now[0])
    assert barrier.hold([delivery(6)]) is None
    now[0] = 26.0
    assert [d.stream_seq for d in barrier.hold([])] == [6]


def test_a_consumer_whose_predecessor_left_nothing_outstanding_starts_open():
    first = [delivery(1)]
    assert RestartBarrier(outstanding=0, last_delivered=9, ack_wait_s=10.0).hold(first) is first
