"""The front's admission cap, counted in sequences: a request asking for `n` choices holds n.

Requests wait (in arrival order) until the sequences in flight plus theirs fit under the
cap; one that could never fit runs alone once nothing else is in flight, so a request for
more choices than the cap is slowed, never refused. The cap is set from the control loop's
thread; everything else runs on the event loop. It must not talk to the server.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque


class Admission:
    """A sequence counter with a cap that can move while requests wait."""

    def __init__(self, max_num_seqs: int) -> None:
        if max_num_seqs < 1:
            raise ValueError("admission max_num_seqs must be >= 1")
        self._cap = max_num_seqs
        self._in_flight = 0
        self._in_flight_requests = 0
        self._queue: deque[tuple[int, asyncio.Future]] = deque()
        self._lock = threading.Lock()  # the cap and counters are read from other threads
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def max_num_seqs(self) -> int:
        return self._cap

    @property
    def in_flight_seqs(self) -> int:
        return self._in_flight

    @property
    def in_flight_requests(self) -> int:
        return self._in_flight_requests

    @property
    def waiting_requests(self) -> int:
        return len(self._queue)

    def set_max_num_seqs(self, max_num_seqs: int) -> None:
        """Any thread: the new cap; waiters that now fit are admitted."""
        if max_num_seqs < 1:
            raise ValueError("admission max_num_seqs must be >= 1")
        with self._lock:
            self._cap = max_num_seqs
            loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._admit_waiters)

    def _fits(self, n: int) -> bool:
        return self._in_flight + n <= self._cap or self._in_flight == 0

    def _admit_waiters(self) -> None:
        with self._lock:
            while self._queue:
                n, fut = self._queue[0]
                if fut.done():  # its client gave up while it waited
                    self._queue.popleft()
                    continue
                if not self._fits(n):
                    break
                self._queue.popleft()
                self._in_flight += n
                self._in_flight_requests += 1
                fut.set_result(None)

    async def acquire(self, n: int) -> None:
        """Wait until n sequences fit; they are held until release(n)."""
        if n < 1:
            raise ValueError("a request holds at least one sequence")
        loop = asyncio.get_running_loop()
        with self._lock:
            self._loop = loop
            if not self._queue and self._fits(n):
                self._in_flight += n
                self._in_flight_requests += 1
                return
            fut: asyncio.Future = loop.create_future()
            self._queue.append((n, fut))
        try:
            await fut
        except asyncio.CancelledError:
            with self._lock:
                admitted = fut.done() and not fut.cancelled()
                if not admitted:
                    fut.cancel()
            if admitted:
                self.release(n)
            raise

    def release(self, n: int) -> None:
        with self._lock:
            self._in_flight = max(0, self._in_flight - n)
            self._in_flight_requests = max(0, self._in_flight_requests - 1)
        self._admit_waiters()
