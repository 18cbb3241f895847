"""RoomQueue: requests waiting for decode room are woken one at a time, oldest first, and newest
first while the oldest is already late."""

from __future__ import annotations

from coordinator.room import RoomQueue


def line(late_after_s: float | None = None) -> tuple[RoomQueue, list[str], list[float]]:
    now = [100.0]
    return RoomQueue(lambda: now[0], late_after_s), [], now


def test_freed_wakes_only_the_oldest() -> None:
    room, woken, _ = line()
    for arrived, name in ((3.0, "c"), (1.0, "a"), (2.0, "b")):  # joined out of order
        room.wait(lambda name=name: woken.append(name), arrived)
    room.freed()
    assert woken == ["a"] and len(room) == 2
    room.freed()
    room.freed()
    room.freed()  # nobody left: nothing happens
    assert woken == ["a", "b", "c"] and len(room) == 0


def test_a_refused_waiter_takes_its_place_again() -> None:
    room, woken, _ = line()
    wake_a = lambda: woken.append("a")  # noqa: E731
    room.wait(wake_a, 1.0)
    room.wait(lambda: woken.append("b"), 2.0)
    room.freed()
    room.wait(wake_a, 1.0)  # a found no room after all: still ahead of b
    room.freed()
    assert woken == ["a", "a"]


def test_a_waiter_that_leaves_is_never_woken() -> None:
    room, woken, _ = line()
    wake_a = lambda: woken.append("a")  # noqa: E731
    room.wait(wake_a, 1.0)
    room.wait(lambda: woken.append("b"), 2.0)
    room.leave(wake_a)
    room.leave(wake_a)  # twice, or after being woken: harmless
    room.freed()
    assert woken == ["b"]


def test_while_the_oldest_is_late_the_newest_goes_first() -> None:
    room, woken, now = line(late_after_s=3.0)
    for arrived, name in ((96.0, "old"), (98.5, "mid"), (99.5, "new")):
        room.wait(lambda name=name: woken.append(name), arrived)
    room.freed()  # at 100 the oldest has waited 4 s > 3 s: late
    assert woken == ["new"]
    room.freed()
    assert woken == ["new", "mid"]
    now[0] = 98.0  # (were it only 2 s old, it would go first)
    room.wait(lambda: woken.append("newer"), 97.9)
    room.freed()
    assert woken == ["new", "mid", "old"]
