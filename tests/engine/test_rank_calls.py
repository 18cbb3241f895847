"""RankGroup.call against scripted followers (threads speaking the rank protocol, no model):
a reply that comes after its call's deadline, or that a raise left unread, answers no later
call; each call gets its own rank's answer or fails."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from engine.config import EngineConfig
from engine.tensor_parallel import HELLO, RankGroup, RemoteError, _read
from protocol.wire import frame


def scripted(delays: dict[int, float], fails: set[int]):
    """A launcher whose follower answers call n with ["answer", rank, n] after delays[n]
    seconds (0 if absent), or fails it when n is in `fails`."""

    def launch(spec) -> threading.Thread:
        def follow() -> None:
            connection = socket.create_connection(tuple(spec.control), timeout=10)
            connection.sendall(frame([HELLO, spec.secret, spec.rank]))
            while True:
                try:
                    kind, *body = _read(connection, patient=True)
                except (OSError, EOFError):
                    return
                request, number = body
                time.sleep(delays.get(request[1], 0.0))
                if request[1] in fails and spec.rank == 1:
                    reply = [number, False, "ValueError: no such request"]
                else:
                    reply = [number, True, ["answer", spec.rank, request[1]]]
                connection.sendall(frame(["reply", reply]))

        thread = threading.Thread(target=follow, daemon=True)
        thread.start()
        return thread

    return launch


@pytest.mark.parametrize("size", [2, 3])
def test_a_late_or_unread_reply_answers_no_later_call(tiny_llama, size: int) -> None:
    config = EngineConfig(tiny_llama, tensor_parallel_size=size, rank_timeout=0.5)
    group = RankGroup(config, num_blocks=8, launch=scripted({1: 0.8}, fails={2}))
    group.wait_ready()
    try:
        with pytest.raises(TimeoutError, match="did not answer"):
            group.call(["ask", 1])  # every rank answers after the deadline
        with pytest.raises(RemoteError, match="no such request"):
            group.call(["ask", 2])  # rank 1 fails: the others' replies stay unread
        # Before, these got call 1's late replies, then call 2's.
        assert group.call(["ask", 3]) == [["answer", r, 3] for r in range(1, size)]
        assert group.call(["ask", 4]) == [["answer", r, 4] for r in range(1, size)]
    finally:
        group.close()
