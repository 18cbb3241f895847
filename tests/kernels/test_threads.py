"""A thread's torch thread count survives other threads setting theirs (kernels/threads.py)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.engine_thread import EngineThread
from kernels import cpu_extension
from kernels.threads import use_threads


def _counts_after_other_thread_sets_one(set_count, first_op) -> int:
    """A fresh thread sets 2, another thread then sets 1, and only then does the first run
    its first parallel op: the count that op's thread ends up with."""
    counted, ready, other_done = [], threading.Event(), threading.Event()

    def first() -> None:
        set_count(2)
        ready.set()
        other_done.wait(10)
        first_op()
        counted.append(torch.get_num_threads())

    def other() -> None:
        ready.wait(10)
        torch.set_num_threads(1)
        other_done.set()

    threads = [threading.Thread(target=first), threading.Thread(target=other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return counted[0]


def _torch_op() -> None:
    torch.ones(64, 64).exp()


def _native_op() -> None:  # at::parallel_for inside our C++ kernels, a library of its own
    native = cpu_extension.load()
    assert native is not None, "these tests need the C++ kernels"
    native.silu_and_mul(torch.ones(64, 128, dtype=torch.bfloat16))


@pytest.mark.parametrize("first_op", [_torch_op, _native_op])
def test_plain_set_num_threads_is_overridden_by_another_thread(first_op):
    # The behaviour use_threads exists for: if this starts failing, torch changed it.
    assert _counts_after_other_thread_sets_one(torch.set_num_threads, first_op) == 1


@pytest.mark.parametrize("first_op", [_torch_op, _native_op])
def test_use_threads_keeps_its_count(first_op):
    cpu_extension.load()  # loaded before any engine thread starts, as the model runner does
    assert _counts_after_other_thread_sets_one(use_threads, first_op) == 2


def test_engine_thread_keeps_its_creators_count_when_a_receiver_sets_one():
    """The decode worker's bug: its KV receiver threads (one thread each) started before the
    engine thread's first step, and the engine then stepped on one core."""
    seen: list[int] = []
    receiver_set = threading.Event()
    previous = torch.get_num_threads()
    cpu_extension.load()
    try:
        torch.set_num_threads(2)
        engine = EngineThread(
            "test-engine",
            step=lambda: seen.append((_native_op(), torch.get_num_threads())[1]),
            has_work=lambda: receiver_set.is_set() and not seen,
            on_crash=lambda err: None,
        )
        receiver = threading.Thread(target=lambda: (use_threads(1), receiver_set.set()))
        receiver.start()
        receiver.join(10)
        for _ in range(200):  # 10 s at most
            if seen:
                break
            time.sleep(0.05)
        engine.stop()
    finally:
        torch.set_num_threads(previous)
    assert seen == [2]


def test_threads_that_never_asked_start_on_one_core():
    """After an engine thread takes two cores, a thread that set nothing (a KV sender copying
    a tensor, an asyncio helper) runs its first op on one and so opens no team of its own."""
    counts: dict[str, int] = {}

    def engine() -> None:
        use_threads(2)
        counts["engine"] = torch.get_num_threads()

    def bystander() -> None:
        torch.ones(256, 256).exp()
        counts["bystander"] = torch.get_num_threads()

    for target in (engine, bystander):
        thread = threading.Thread(target=target)
        thread.start()
        thread.join(10)
    assert counts == {"engine": 2, "bystander": 1}
