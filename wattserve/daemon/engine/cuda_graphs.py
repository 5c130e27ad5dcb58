"""CUDA graphs of every step: one per (quantization level, step bucket), all captured at start.

On CUDA a step of a small model is mostly kernel-launch overhead; replaying a captured
graph launches it all at once. StepGraphs.capture_all() captures, before the engine
serves, one graph for every bucket (step_buckets.py) the start's limits can meet: decode
steps of 1 .. max_num_seqs tokens and mixed steps (decodes and prompt chunks together) of
2 .. max_num_batched_tokens tokens, both up to `engine.cuda_graph_max_tokens`, at every
block-table width up to max_model_len's, for every quantization level prepared at start
(a graph holds the weights it was captured with). run() replays the bucket a step pads
into and never captures: a step larger than the largest bucket, one at a level prepared
later, or one whose rows needing logits outnumber its bucket's runs eagerly (run() says
None). Mixed buckets are captured only with the Triton attention, which reads a step's
chunk bounds from device tensors; the torch fallback reads them on the host.

Every graph's inputs are its bucket's static buffer (shared between levels) and its
logits land in one output buffer shared by all graphs: read a step's logits (launch the
sampler) before the next step is launched. Graphs share one memory pool. The capture call
itself is a seam (`capture` below, given to StepGraphs): on CUDA torch.cuda.CUDAGraph, in
the CPU tests a stand-in that runs the step once; everything else is the same code.
It does not schedule, sample nor choose the level.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import torch

from wattserve.daemon.engine.model import LlamaModel, StepLayout
from wattserve.daemon.engine.step_buckets import (
    Bucket,
    StaticStepInputs,
    next_power_of_two,
    step_kind,
    token_bucket,
    width_bucket,
)

log = logging.getLogger(__name__)

# Devices the engine captures graphs on; the CPU tests add "cpu" with a stand-in capture.
GRAPH_DEVICES = {"cuda"}
Replay = Callable[[], None]
Capture = Callable[[Replay, torch.device, object], Replay]


def capture_cuda_graph(run: Replay, device: torch.device, pool: object) -> Replay:
    """Capture run() (one step's forward into static buffers) as a CUDA graph in `pool`,
    after two warm-up runs on a side stream (cuBLAS workspaces, Triton compiles, lazy
    inits); returns the graph's replay."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        run()
    return graph.replay


def graphs_supported(device: torch.device) -> bool:
    return device.type in GRAPH_DEVICES


def powers_of_two(low: int, high: int) -> list[int]:
    """The powers of two in [low, high]."""
    out, p = [], next_power_of_two(low)
    while p <= high:
        out.append(p)
        p *= 2
    return out


class StepGraphs:
    """Captures every bucket's graph at start (capture_all) and replays them (run)."""

    def __init__(
        self,
        model: LlamaModel,
        max_tokens: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        capture: Capture | None = None,
    ) -> None:
        """max_tokens: engine.cuda_graph_max_tokens (a power of two); max_num_seqs and
        max_num_batched_tokens: the start's step limits; capture: the capture call
        (capture_cuda_graph by default)."""
        self.model = model
        self.max_tokens = max_tokens
        self.max_num_seqs = max_num_seqs
        self.max_blocks = -(-max_model_len // model.block_size)
        self._capture = capture or capture_cuda_graph
        self._pool = torch.cuda.graph_pool_handle() if model.device.type == "cuda" else None
        decode = powers_of_two(1, min(max_tokens, next_power_of_two(max_num_seqs)))
        mixed: list[int] = []
        if model.attention_backend in ("triton", "cpp"):  # chunk bounds read on the device
            mixed = powers_of_two(2, min(max_tokens, next_power_of_two(max_num_batched_tokens)))
        widths = sorted(set(powers_of_two(1, self.max_blocks)) | {self.max_blocks})
        self.buckets = [Bucket("decode", t, w, t) for t in decode for w in widths] + [
            Bucket("mixed", t, w, min(t - 1, max_num_seqs)) for t in mixed for w in widths
        ]
        self._largest = {
            k: max((b.tokens for b in self.buckets if b.kind == k), default=0)
            for k in ("decode", "mixed")
        }
        rows = max((b.logits_rows for b in self.buckets), default=0)
        self.logits = torch.empty(
            rows, model.shape.vocab_size, dtype=torch.float32, device=model.device
        )
        self._static: dict[Bucket, StaticStepInputs] = {}
        self._graphs: dict[tuple[str, Bucket], Replay] = {}

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    def capture_all(self, levels: Iterable[str]) -> None:
        """Capture every bucket at each of `levels` (prepared ones), then restore the
        model's active level. Call once, before serving."""
        active = self.model.level
        t0 = time.monotonic()
        try:
            for level in levels:
                self.model.use_level(level)
                for bucket in self.buckets:
                    self._graphs[(level, bucket)] = self._capture_one(bucket)
        finally:
            self.model.use_level(active)
        log.info(
            "captured %d CUDA graphs (levels %s; decode up to %d tokens, mixed up to %d, "
            "table widths up to %d blocks) in %.1f s",
            self.num_captured,
            ", ".join(sorted({lvl for lvl, _ in self._graphs})) or "none",
            self._largest["decode"],
            self._largest["mixed"],
            self.max_blocks,
            time.monotonic() - t0,
        )

    def _capture_one(self, bucket: Bucket) -> Replay:
        static = self._static.get(bucket)
        if static is None:
            static = self._static[bucket] = StaticStepInputs.allocate(self.model, bucket)
        out = self.logits.narrow(0, 0, bucket.logits_rows)
        model = self.model

        def run() -> None:
            out.copy_(model.forward(static.inputs))

        return self._capture(run, model.device, self._pool)

    def bucket(self, lay: StepLayout) -> Bucket | None:
        """The bucket a layout would replay, or None (run it eagerly)."""
        n = len(lay.input_ids)
        if n == 0:
            return None
        kind = step_kind(lay)
        tokens = token_bucket(n, self._largest[kind])
        if tokens is None:
            return None
        widest = max((len(r) for r in lay.block_tables), default=0)
        width = width_bucket(widest, self.max_blocks)
        rows = tokens if kind == "decode" else min(tokens - 1, self.max_num_seqs)
        bucket = Bucket(kind, tokens, width, rows)
        return bucket if bucket.fits(lay) else None

    def run(self, lay: StepLayout, before_replay=None) -> torch.Tensor | None:
        """Logits [len(lay.logits_indices), vocab] of a layout through its graph, or None
        when it has none (run it eagerly). The tensor is a view of the shared output
        buffer: valid until the next replay. before_replay(inputs): called on the loaded
        static inputs (the engine puts device-side input ids there)."""
        bucket = self.bucket(lay)
        replay = None if bucket is None else self._graphs.get((self.model.level, bucket))
        if replay is None:
            return None
        inputs = self._static[bucket].load(self.model, lay)
        if before_replay is not None:
            before_replay(inputs)
        replay()
        return self.logits.narrow(0, 0, len(lay.logits_indices))
