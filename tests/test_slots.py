"""`flywheel.envs.slots.SlotPool`: one pool of numbered slots for threads and coroutines alike."""

import asyncio
import threading

from flywheel.envs.slots import SlotPool

from waiting import until


def waiting_in(pool: SlotPool) -> int:
    """How many takers wait in line (a cancelled one too, until a slot passes it by)."""
    return len(pool._waiters)


async def test_coroutines_wait_for_a_slot_and_get_it_in_order():
    pool = SlotPool([0, 1])
    a, b = await pool.take_async(), await pool.take_async()
    waiters = [asyncio.create_task(pool.take_async()) for _ in range(2)]
    await until(lambda: waiting_in(pool) == 2)
    assert not any(w.done() for w in waiters)
    pool.give(b)
    assert await waiters[0] == b and not waiters[1].done()
    pool.give(a)
    assert await waiters[1] == a and len(pool) == 0


async def test_a_waiter_cancelled_takes_no_slot_with_it():
    pool = SlotPool([7])
    held = await pool.take_async()
    gone = asyncio.create_task(pool.take_async())
    await until(lambda: waiting_in(pool) == 1)
    gone.cancel()
    later = asyncio.create_task(pool.take_async())
    await until(lambda: waiting_in(pool) == 2)  # behind the cancelled one
    pool.give(held)
    assert await asyncio.wait_for(later, 5) == 7


async def test_threads_and_coroutines_share_one_pool():
    pool = SlotPool([0])
    slot = pool.take()
    got: list[int] = []
    thread = threading.Thread(target=lambda: got.append(pool.take()))
    thread.start()
    await until(lambda: waiting_in(pool) == 1)  # the thread waits first
    waiting = asyncio.create_task(pool.take_async())
    await until(lambda: waiting_in(pool) == 2)
    pool.give(slot)
    await asyncio.to_thread(thread.join, 5)
    assert got == [0] and not waiting.done()
    pool.give(got[0])
    assert await asyncio.wait_for(waiting, 5) == 0
    pool.give(0)
    with pool.held() as again:  # the sync context manager gives it back
        assert again == 0 and len(pool) == 0
    assert len(pool) == 1
