"""uvicorn's Server without its own signal handling, for processes that install their own.

uvicorn would close the listening socket at once on SIGTERM and re-raise the signal once it
has stopped (the process then dies of it instead of exiting 0). It must hold nothing else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator

import uvicorn


class QuietSignalsServer(uvicorn.Server):
    """uvicorn without its own signal handlers (the process installs and interprets them)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield
