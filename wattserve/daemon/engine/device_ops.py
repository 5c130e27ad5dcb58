"""The engine's device operations: pinned buffers, non-blocking copies, events, launches.

Every pinned-buffer allocation, host-to-device and device-to-host copy, event record and
event wait of the engine's step goes through one DeviceOps, so that what a step asks of the
device is in one place and can be recorded:

- CudaOps calls torch (pinned memory, `copy_(non_blocking=True)`, torch.cuda.Event).
- RecordingOps runs the same calls on the CPU (or under a fake CUDA device) and keeps the
  ordered list of what was asked (`ops`): launch of a step, h2d and d2h copies (pinned or
  pageable), event record, event wait. Its `watch()` dispatch mode adds what bypassed it
  (a `.item()`, `.tolist()` or `.cpu()` of a device tensor, an upload from pageable
  memory), which a fake CUDA device cannot otherwise tell apart. `summary()` turns the
  record into `bench host`'s keys.

Buffers are persistent and handed out in rings (`Ring`): with at most two uploads and
one read-back a step, a slot is reused three or more steps later, when the stream has
finished the copy that read or wrote it (the engine waits on a step's read-back before
launching the step two after it, and reads that read-back before then). This module computes
nothing and decides nothing; it only moves bytes and orders the stream.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

RING_SLOTS = 8  # at most two uploads a step: a slot is reused four steps later


class DeviceOps:
    """CUDA: torch's pinned memory, non-blocking copies and events on the current stream."""

    recording = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A page-locked host buffer (allocated once, reused through a Ring)."""
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=True)

    def upload(self, src: torch.Tensor, dst: torch.Tensor | None = None) -> torch.Tensor:
        """Copy pinned host `src` to the device (into dst if given), ordered on the stream."""
        if dst is None:
            return src.to(self.device, non_blocking=True)
        return dst.copy_(src, non_blocking=True)

    def read_back(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy device `src` into pinned host `dst` without waiting for it."""
        dst.copy_(src, non_blocking=True)

    def record_event(self, step: int):
        event = torch.cuda.Event()
        event.record()
        return event

    def wait(self, event) -> None:
        """Block the host until the stream has passed `event` (a read-back is complete)."""
        event.synchronize()

    def launched(self, step: int) -> None:
        """Mark the launch of a step's forward (only recorded by RecordingOps)."""

    def values(self, host: torch.Tensor) -> list:
        """The contents of a host buffer whose read-back was waited on, as a list."""
        return host.tolist()


@dataclass(frozen=True)
class RecordedEvent:
    step: int


class RecordingOps(DeviceOps):
    """The same operations done in order on the CPU (or a fake device), and recorded.

    `ops` holds tuples: ("launch", step), ("h2d", "pinned"|"pageable"),
    ("d2h", "pinned"|"pageable", non_blocking), ("event", step), ("wait", step),
    ("blocking_read", op name).
    """

    recording = True

    def __init__(self, device: torch.device, fill=None) -> None:
        """fill(n) -> n values: what values() returns in place of a buffer's (under a fake
        device, whose tensors hold none); None: the buffer's own."""
        super().__init__(device)
        self.fill = fill
        self.ops: list[tuple] = []
        self._pinned: set[int] = set()  # ids of the buffers pinned() handed out
        self._own_copy = False  # a copy of ours is in progress (watch() skips it)

    def pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buf = torch.empty(numel, dtype=dtype, device="cpu")
        self._pinned.add(id(buf))
        return buf

    def is_pinned(self, t: torch.Tensor) -> bool:
        return id(t) in self._pinned or (t._base is not None and id(t._base) in self._pinned)

    def upload(self, src: torch.Tensor, dst: torch.Tensor | None = None) -> torch.Tensor:
        self.ops.append(("h2d", "pinned" if self.is_pinned(src) else "pageable"))
        with self._ours():
            if dst is None:
                return src.to(self.device, copy=True)
            return dst.copy_(src)

    def read_back(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.ops.append(("d2h", "pinned" if self.is_pinned(dst) else "pageable", True))
        with self._ours():
            dst.copy_(src)

    def record_event(self, step: int) -> RecordedEvent:
        self.ops.append(("event", step))
        return RecordedEvent(step)

    def wait(self, event: RecordedEvent) -> None:
        self.ops.append(("wait", event.step))

    def launched(self, step: int) -> None:
        self.ops.append(("launch", step))

    def values(self, host: torch.Tensor) -> list:
        if self.fill is not None:  # a fake tensor has no values: the caller's stand-ins
            return self.fill(host.numel())
        return host.tolist()

    @contextlib.contextmanager
    def _ours(self):
        self._own_copy = True
        try:
            yield
        finally:
            self._own_copy = False

    def watch(self) -> _Watch:
        """A dispatch mode that records device reads and uploads that bypass these ops."""
        return _Watch(self)

    def summary(self) -> dict[str, int]:
        return summarize(self.ops)


_SCALAR = torch.ops.aten._local_scalar_dense.default


class _Watch(TorchDispatchMode):
    """Adds to a RecordingOps' record every scalar read or copy of a non-CPU tensor to
    the host (each blocks the host until the device is done) and every copy from host
    memory to the device that did not go through the ops (pageable)."""

    def __init__(self, ops: RecordingOps) -> None:
        super().__init__()
        self.rec = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = torch.utils._pytree.tree_flatten((args, kwargs))
        inputs = [t for t in flat if isinstance(t, torch.Tensor)]
        on_device = [t.device.type != "cpu" for t in inputs]
        if func is _SCALAR:
            if any(on_device):
                self.rec.ops.append(("blocking_read", str(func)))
            if self.rec.fill is not None:
                return self.rec.fill(1)[0]  # a fake tensor has no value to read
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if self.rec._own_copy:
            return out
        outs = [t for t in torch.utils._pytree.tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if outs and inputs and _is_copy(func):
            # copy_(dst, src): the first input is the destination
            src = inputs[1] if func is torch.ops.aten.copy_.default else inputs[0]
            dst = outs[0]
            if src.device.type != "cpu" and dst.device.type == "cpu":
                self.rec.ops.append(("blocking_read", str(func)))
            elif src.device.type == "cpu" and dst.device.type != "cpu":
                self.rec.ops.append(("h2d", "pageable"))
        return out


def _is_copy(func) -> bool:
    return func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default) or (
        func.overloadpacket in (torch.ops.aten.to, torch.ops.aten.lift_fresh_copy)
    )


def summarize(ops: list[tuple]) -> dict[str, int]:
    """Per launch interval (from a step's launch to the next launch): the most blocking
    waits on that step's own read-back or blocking reads (syncs_before_next_launch), d2h
    copies, d2h copies not pinned and non-blocking, and pageable h2d copies."""
    intervals: list[dict[str, int]] = []
    current: dict[str, int] | None = None
    step = None
    for op in ops:
        kind = op[0]
        if kind == "launch":
            current = {"syncs": 0, "d2h": 0, "d2h_unpinned": 0, "h2d_pageable": 0}
            intervals.append(current)
            step = op[1]
            continue
        if current is None:
            continue
        if kind == "blocking_read" or (kind == "wait" and op[1] == step):
            current["syncs"] += 1
        elif kind == "d2h":
            current["d2h"] += 1
            current["d2h_unpinned"] += not (op[1] == "pinned" and op[2])
        elif kind == "h2d" and op[1] == "pageable":
            current["h2d_pageable"] += 1
    # Syncs count only between two launches; the last interval has no next launch.
    between = intervals[:-1]
    return {
        "syncs_before_next_launch": max((i["syncs"] for i in between), default=0),
        "d2h_copies_per_step": max((i["d2h"] for i in intervals), default=0),
        "unpinned_or_blocking_d2h_copies": sum(i["d2h_unpinned"] for i in intervals),
        "pageable_h2d_copies_per_step": max((i["h2d_pageable"] for i in intervals), default=0),
        "launches": len(intervals),
    }


class Ring:
    """RING_SLOTS persistent buffers of one dtype, handed out in turn; a slot grows (is
    reallocated) when a step needs more than it holds."""

    def __init__(self, alloc, dtype: torch.dtype) -> None:
        self._alloc = alloc  # (numel, dtype) -> Tensor
        self._dtype = dtype
        self._slots: list[torch.Tensor | None] = [None] * RING_SLOTS
        self._next = 0

    def take(self, numel: int) -> torch.Tensor:
        """The next slot, as a view of exactly numel elements."""
        i = self._next
        self._next = (i + 1) % RING_SLOTS
        buf = self._slots[i]
        if buf is None or buf.numel() < numel:
            buf = self._slots[i] = self._alloc(max(numel, 64) * 2, self._dtype)
        return buf.narrow(0, 0, numel)
