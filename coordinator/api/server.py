"""Running the app under uvicorn with a graceful drain.

uvicorn's own shutdown closes the listening socket at once, so a request arriving during a
drain would be refused at the TCP level with no explanation. Here the first SIGINT/SIGTERM only
starts draining: the socket stays open and new generation requests get 503, while requests in
flight run to completion or until the grace period ends. Then uvicorn's shutdown runs (requests
still running are cancelled, which aborts them) and the app's lifespan stops the backend.
A second signal skips the rest of the drain; a third exits without stopping the backend.
A signal while the workers are still starting stops the start (StartupInterrupted).
"""

from __future__ import annotations

import gc
import logging
import signal
import socket
import time
from types import FrameType

import uvicorn

from coordinator.api.admission import Admission

log = logging.getLogger(__name__)
# uvicorn's wait for responses still open after the drain, before it cancels them; pass it as
# the Config's timeout_graceful_shutdown.
CANCEL_AFTER_DRAIN_S = 1.0
# Past the grace, how long streams get to end with their error event (at their next output)
# before uvicorn's shutdown cuts what is left.
END_STREAMS_S = 1.0


class StartupInterrupted(BaseException):
    """SIGINT or SIGTERM came before the server took its first request: nothing to drain.

    A BaseException, as KeyboardInterrupt is: the signal lands in whatever code is running,
    and libraries on the start path (inspect.getfullargspec under Ray's actor creation) turn
    any Exception into their own error."""


def interrupt(sig: int, frame: FrameType | None) -> None:
    """A signal handler for the time before serving: unwinds whatever is starting."""
    raise StartupInterrupted(signal.Signals(sig).name)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, admission: Admission, grace_s: float) -> None:
        if config.timeout_graceful_shutdown is None:  # uvicorn would wait on a stuck stream forever
            raise ValueError("DrainingServer needs a Config with timeout_graceful_shutdown")
        super().__init__(config)
        self.admission = admission
        self.grace_s = grace_s
        self.drain_deadline: float | None = None
        self.end_deadline: float | None = None  # set when the grace is over

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            # What lives as long as the server (Ray, the tokenizer, the app's models: ~400,000
            # objects) leaves the cycle collector's sight. Each full collection rescanned them
            # all, a ~0.3 s pause of every stream (docs/performance.md).
            gc.collect()
            gc.freeze()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.started:  # still waiting for the workers: stop waiting, nothing to drain
            interrupt(sig, frame)
        # Not recorded in uvicorn's captured signals: it would re-raise them after shutdown,
        # and SIGINT would then end the process with KeyboardInterrupt instead of exit 0.
        if self.drain_deadline is None:
            log.info(
                "%s: draining; new requests get 503, %d in flight get up to %.0f s",
                signal.Signals(sig).name, self.admission.num_in_flight, self.grace_s,
            )  # fmt: skip
            self.admission.start_draining()
            self.drain_deadline = time.monotonic() + self.grace_s
        elif not self.should_exit:
            log.info("second signal: stopping without waiting for the rest of the drain")
            self.should_exit = True
        else:
            self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None:
            if self.admission.idle:
                log.info("drained: every request in flight has finished")
                return True
            now = time.monotonic()
            if self.end_deadline is None and now >= self.drain_deadline:
                log.warning("grace period over: ending %d requests", self.admission.num_in_flight)
                self.admission.end_in_flight()
                self.end_deadline = now + END_STREAMS_S
            if self.end_deadline is not None and now >= self.end_deadline:
                return True
        return await super().on_tick(counter)
