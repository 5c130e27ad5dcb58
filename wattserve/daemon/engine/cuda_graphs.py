"""CUDA graphs of the decode step, one per (quantization level, batch bucket, table width).

On CUDA a decode step of a small model is mostly kernel-launch overhead; replaying a
captured graph launches it all at once. A graph is captured lazily, the first time its
bucket is met (a few hundred ms each), over static input buffers (decode_buckets.py)
that later steps are copied into; every graph shares one memory pool. Prefill and mixed
steps never come here: they run eagerly. The active quantization level is part of the
key because a graph holds the weight tensors it was captured with.
Only ever constructed on a CUDA device; not exercised by the CPU test suite (capture
needs a real GPU: `wattserve bench gpu` runs it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from wattserve.daemon.engine.decode_buckets import StaticDecodeInputs, batch_bucket, width_bucket
from wattserve.daemon.engine.model import LlamaModel, StepLayout

log = logging.getLogger(__name__)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    static: StaticDecodeInputs
    logits: torch.Tensor  # [batch, vocab] float32, written by every replay


class DecodeGraphs:
    """Runs decode-only steps through captured graphs; the caller runs the rest eagerly."""

    def __init__(self, model: LlamaModel, max_batch: int, max_model_len: int) -> None:
        if model.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model = model
        self.max_batch = max_batch
        self.max_blocks = -(-max_model_len // model.block_size)
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[str, int, int], _Graph] = {}

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    def key(self, lay: StepLayout) -> tuple[str, int, int] | None:
        """The graph a layout would replay, or None: not a decode step, or too big."""
        n = len(lay.input_ids)
        if n == 0 or n != len(lay.context_lens):
            return None
        batch = batch_bucket(n, self.max_batch)
        if batch is None:
            return None
        widest = max(len(r) for r in lay.block_tables)
        return (self.model.level, batch, width_bucket(widest, self.max_blocks))

    def run(self, lay: StepLayout, before_replay=None) -> torch.Tensor | None:
        """Logits [n, vocab] of a decode layout through its graph (captured now if new),
        or None when the layout has no graph (run it eagerly). before_replay(inputs): called
        on the loaded static inputs (the engine puts device-side input ids there)."""
        key = self.key(lay)
        if key is None:
            return None
        entry = self._graphs.get(key) or self._capture(key)
        inputs = entry.static.load(self.model, lay)
        if before_replay is not None:
            before_replay(inputs)
        entry.graph.replay()
        return entry.logits.narrow(0, 0, len(lay.input_ids))

    def _capture(self, key: tuple[str, int, int]) -> _Graph:
        level, batch, width = key
        static = StaticDecodeInputs.allocate(self.model, batch, width)
        # Warm-up on a side stream (cuBLAS workspaces, lazy inits) before capturing.
        side = torch.cuda.Stream(self.model.device)
        side.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.model.forward(static.inputs)
        torch.cuda.current_stream(self.model.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.model.forward(static.inputs)
        entry = _Graph(graph, static, logits)
        self._graphs[key] = entry
        log.info("captured the decode graph for level %s, batch %d, width %d", *key)
        return entry
