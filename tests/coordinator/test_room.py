"""RoomQueue: requests waiting for decode room are woken one at a time, in arrival order."""

from __future__ import annotations

from coordinator.room import RoomQueue


def test_freed_wakes_only_the_first_in_line() -> None:
    room, woken = RoomQueue(), []
    for name in "abc":
        room.wait(lambda name=name: woken.append(name))
    room.freed()
    assert woken == ["a"] and len(room) == 2
    room.freed()
    room.freed()
    room.freed()  # nobody left: nothing happens
    assert woken == ["a", "b", "c"] and len(room) == 0


def test_a_refused_waiter_goes_back_to_the_front() -> None:
    room, woken = RoomQueue(), []
    wake_a = lambda: woken.append("a")  # noqa: E731
    room.wait(wake_a)
    room.wait(lambda: woken.append("b"))
    room.freed()
    room.wait(wake_a, front=True)  # a found no room after all
    room.freed()
    assert woken == ["a", "a"]


def test_a_waiter_that_leaves_is_never_woken() -> None:
    room, woken = RoomQueue(), []
    wake_a = lambda: woken.append("a")  # noqa: E731
    room.wait(wake_a)
    room.wait(lambda: woken.append("b"))
    room.leave(wake_a)
    room.leave(wake_a)  # twice, or after being woken: harmless
    room.freed()
    assert woken == ["b"]
