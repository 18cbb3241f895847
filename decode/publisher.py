"""UpdatePublisher: pushes a decode worker's token updates to the coordinator.

One thread per connection takes every update published since its last send and writes them as
one frame (protocol/wire.py): a batch per engine step, or several steps' worth when the network
is slower than the engine. The engine thread only appends to a list, so it never waits on the
coordinator or the network.

The connection is the worker's one line to the coordinator: when it breaks (either side), the
publisher stops and the coordinator retires the worker. Every send has a deadline, so a
coordinator that stops reading cannot hold this thread forever.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable

from protocol.kv import Endpoint
from protocol.messages import WorkerUpdate
from protocol.wire import hello, update_frames

log = logging.getLogger(__name__)
CONNECT_TIMEOUT = 10.0
SEND_TIMEOUT = 30.0
TAKE_SECONDS = 0.25  # how often an idle publisher checks whether it should stop


class UpdatePublisher:
    def __init__(
        self,
        take: Callable[[float], list[WorkerUpdate]],
        endpoint: Endpoint,
        worker_id: str,
        secret: str,
    ) -> None:
        """Connects (OSError if the coordinator cannot be reached in time) and starts sending.
        `take(timeout)` returns the updates published since its last call, waiting up to
        `timeout` for one, and raises once the worker can publish no more (a crashed engine)."""
        self._take = take
        self._sock = socket.create_connection(tuple(endpoint), timeout=CONNECT_TIMEOUT)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.settimeout(SEND_TIMEOUT)
        self._sock.sendall(hello(worker_id, secret))
        self._stopped = threading.Event()
        self.frames_sent = 0
        self._thread = threading.Thread(target=self._run, name=f"updates-{worker_id}", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 5.0) -> None:
        """Stops sending and closes the connection (the coordinator reads its end)."""
        self._stopped.set()
        self._thread.join(timeout)
        self._sock.close()

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                updates = self._take(TAKE_SECONDS)
                for payload in update_frames(updates) if updates else ():
                    self._sock.sendall(payload)
                    self.frames_sent += 1
        except Exception as err:  # the engine crashed or the connection broke: say so by closing
            log.warning("update stream ends: %s: %s", type(err).__name__, err)
        finally:
            self._stopped.set()
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
