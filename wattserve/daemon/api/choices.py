"""One OpenAI request's choices: an engine sequence per (prompt, sample), merged back.

`n` samples of each prompt, and each prompt of a batched completions request, run as
independent engine requests (different seeds; the KV cache shares their prompt blocks
once prefix caching lands). This module starts them together, merges their events into
one ordered-by-arrival feed tagged with the choice index, and closes them all together.
It must not format responses (openai.py does) nor touch the engine beyond the bridge.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.types import Receive

from wattserve.daemon.api.generation import ClientGone, GenerationStream, start_generation
from wattserve.daemon.api.state import ServingState
from wattserve.daemon.engine.request import RequestOutput, SamplingParams


@dataclass(frozen=True)
class ChoiceSpec:
    """What one choice runs: its index in the response, prompt and sampling."""

    index: int
    prompt_index: int
    prompt_token_ids: list[int]
    params: SamplingParams


class Choices:
    """The streams of one request, each finished once its last event was taken."""

    def __init__(self, streams: list[GenerationStream], specs: list[ChoiceSpec]) -> None:
        self.streams = streams
        self.specs = specs

    @property
    def prompt_tokens(self) -> int:
        """Each prompt counted once, however many samples it has."""
        seen: dict[int, int] = {}
        for spec, s in zip(self.specs, self.streams, strict=True):
            seen[spec.prompt_index] = s.prompt_tokens
        return sum(seen.values())

    @property
    def completion_tokens(self) -> int:
        return sum(s.completion_tokens for s in self.streams)

    def close(self) -> None:
        """Idempotent; aborts in the engine whichever choices have not finished."""
        for s in self.streams:
            s.close()

    def abort(self) -> None:
        for s in self.streams:
            s.abort()

    def client_gone(self) -> None:
        for s in self.streams:
            s.client_gone()

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, event) as they come, until every choice has finished; raises
        ClientGone once client_gone() was called."""
        if len(self.streams) == 1:
            stream, spec = self.streams[0], self.specs[0]
            while True:
                out = await stream.next_event()
                yield spec.index, out
                if out.finished:
                    return
        merged: asyncio.Queue[tuple[int, RequestOutput | None]] = asyncio.Queue()

        async def pump(index: int, stream: GenerationStream) -> None:
            try:
                while True:
                    out = await stream.next_event()
                    merged.put_nowait((index, out))
                    if out.finished:
                        return
            except ClientGone:
                merged.put_nowait((index, None))

        tasks = [
            asyncio.create_task(pump(spec.index, s))
            for spec, s in zip(self.specs, self.streams, strict=True)
        ]
        try:
            remaining = len(tasks)
            while remaining:
                index, out = await merged.get()
                if out is None:
                    raise ClientGone
                if out.finished:
                    remaining -= 1
                yield index, out
        finally:
            for t in tasks:
                t.cancel()

    async def watch_disconnect(self, receive: Receive) -> None:
        # The body was read already: the next message is http.disconnect, whenever it comes.
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.client_gone()
                return


def start_choices(
    state: ServingState, specs: list[ChoiceSpec], request_id: str, arrival_s: float
) -> Choices:
    """Admit and queue every choice, or none: a refusal closes those already started.
    Raises Unavailable or InvalidRequestError like start_generation."""
    streams: list[GenerationStream] = []
    try:
        for spec in specs:
            rid = request_id if len(specs) == 1 else f"{request_id}-{spec.index}"
            streams.append(
                start_generation(state, spec.prompt_token_ids, spec.params, rid, arrival_s)
            )
    except BaseException:
        for s in streams:
            s.close()
        raise
    return Choices(streams, specs)
