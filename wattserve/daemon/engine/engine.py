"""The engine: request intake, the step loop, and the knobs the controller turns.

Requests come in from any thread through add_request/abort (validated there, queued
for the loop); the loop thread alone owns the scheduler, the KV cache and the model.
Each request's events go out through the sink callable it brought, handed over once per
step: the step's (sink, event) pairs go together to the delivery function (by default each
sink is called in turn on the loop thread; the API installs one that crosses to its asyncio
loop in a single call). With overlap_detokenize (CUDA's default) the next step's forward
is launched before a step's tokens are detokenized, so the host makes text while the device
computes. With async_steps (CUDA's default) a step's tokens are chosen and kept on the
device, the next step is launched before their read-back is waited on, and every pinned
buffer, copy, event and wait goes through device_ops (docs/engine.md). Batch limits and
decode pacing change through set_limits() and the weight quantization level through
set_quant_level(), each read once at the top of each step; per-step statistics go to
registered step hooks. Nothing here awaits, and nothing here
speaks HTTP.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import psutil
import torch

from wattserve.daemon.engine.cuda_graphs import StepGraphs, graphs_supported
from wattserve.daemon.engine.detokenizer import IncrementalDetokenizer
from wattserve.daemon.engine.device_ops import DeviceOps, RecordingOps, Ring
from wattserve.daemon.engine.device_sampler import device_ids, packed_read_back, unpack
from wattserve.daemon.engine.grammar import Grammars, GrammarState, apply_masks
from wattserve.daemon.engine.kv_cache import KVCacheManager, KVCacheSpec, bytes_per_block
from wattserve.daemon.engine.loader import LoadedModel
from wattserve.daemon.engine.logits import RowHistory, logprobs_of, process
from wattserve.daemon.engine.model import LlamaModel, StepInputs, StepLayout, model_shape
from wattserve.daemon.engine.request import (
    InvalidRequestError,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from wattserve.daemon.engine.sampler import make_generator, sample
from wattserve.daemon.engine.scheduler import EngineLimits, SchedulePlan, Scheduler, Sequence
from wattserve.kernels.quant import (
    QuantLevelError,
    default_levels,
    level_unavailable_reason,
    parse_level,
)

log = logging.getLogger(__name__)

Sink = Callable[[RequestOutput], None]
# Receives every (sink, event) pair of one step, in order, on the engine's loop thread.
Delivery = Callable[[list[tuple[Sink, RequestOutput]]], None]


def call_each(batch: list[tuple[Sink, RequestOutput]]) -> None:
    """Each sink called in turn on the calling thread; one that raises is logged and costs
    the others nothing. The default delivery (on the engine's thread), and what the API's
    delivery runs on its loop."""
    for sink, out in batch:
        try:
            sink(out)
        except Exception:
            log.exception("request %s: its sink failed", out.request_id)


# What a request hears when the loop thread died under it (the details go to the log).
ENGINE_FAULT_MESSAGE = "the engine failed; the server is restarting"


@dataclass(frozen=True)
class EngineOptions:
    block_size_tokens: int = 16
    kv_cache_bytes: int | None = None
    kv_cache_memory_fraction: float = 0.10  # CPU: of available host memory
    gpu_memory_utilization: float = 0.90  # CUDA: of the GPU's memory, weights included
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    threads: int | None = None
    quantization_levels: tuple[str, ...] | None = None  # None: default_levels(device)
    quantization_level: str | None = None  # None: the loaded dtype's level
    quant_prepare: str = "lazy"  # "lazy": build a level on first use; "start": all at start
    enable_prefix_caching: bool = True  # share the KV blocks of equal prompt prefixes
    cuda_graphs: bool = True  # CUDA only: replay every step from graphs captured at start
    cuda_graph_max_tokens: int = 512  # the largest step (tokens, a power of two) captured
    # Launch step N+1 before step N's tokens are detokenized; None: on CUDA only (on the
    # CPU the same cores would do both, so nothing overlaps).
    overlap_detokenize: bool | None = None
    # Asynchronous steps: sampled ids stay on the device and feed the next step, which is
    # launched before this one's read-back is waited on; None: on CUDA only (on the CPU
    # it runs with recording device ops, for tests).
    async_steps: bool | None = None

    @classmethod
    def from_config(cls, engine_cfg) -> EngineOptions:
        return cls(
            block_size_tokens=engine_cfg.block_size_tokens,
            kv_cache_bytes=engine_cfg.kv_cache_bytes,
            kv_cache_memory_fraction=engine_cfg.kv_cache_memory_fraction,
            gpu_memory_utilization=engine_cfg.gpu_memory_utilization,
            max_num_seqs=engine_cfg.max_num_seqs,
            max_num_batched_tokens=engine_cfg.max_num_batched_tokens,
            max_model_len=engine_cfg.max_model_len,
            threads=engine_cfg.threads,
            quantization_levels=(
                tuple(engine_cfg.quantization_levels) if engine_cfg.quantization_levels else None
            ),
            quantization_level=engine_cfg.quantization_level,
            quant_prepare=engine_cfg.quant_prepare,
            enable_prefix_caching=engine_cfg.enable_prefix_caching,
            cuda_graphs=engine_cfg.cuda_graphs,
            cuda_graph_max_tokens=engine_cfg.cuda_graph_max_tokens,
            overlap_detokenize=engine_cfg.overlap_detokenize,
            async_steps=getattr(engine_cfg, "async_steps", None),
        )


@dataclass(frozen=True)
class StepStats:
    """What one step did; handed to step hooks (controller, device model, metrics)."""

    step: int
    started_at_s: float  # time.monotonic()
    duration_s: float
    prefill_tokens: int
    decode_tokens: int
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_preempted: int
    num_finished: int
    weight_bytes: int  # weights read by the step's matmuls
    kv_bytes_read: int  # KV cache bytes read by attention
    quant_level: str = "fp32"  # the weight quantization level the step ran at


@dataclass
class EngineCounters:
    requests_finished: dict[str, int] = field(
        default_factory=lambda: {"stop": 0, "length": 0, "abort": 0, "error": 0}
    )
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    preemptions: int = 0
    prefix_cache_queried_tokens: int = 0  # tokens of admitted sequences looked up
    prefix_cache_hit_tokens: int = 0  # of those, found cached and not computed

    @property
    def prefix_cache_hit_ratio(self) -> float | None:
        q = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / q if q else None


@dataclass
class _Request:
    seq: Sequence
    params: SamplingParams
    sink: Sink
    detok: IncrementalDetokenizer
    generator: torch.Generator | None  # None for greedy requests
    arrival_s: float
    first_token_s: float | None = None
    # Prompt logprobs gathered chunk by chunk (first token: None), when asked for.
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=lambda: [None])
    grammar: GrammarState | None = None  # structured outputs: advanced by each sampled token
    history: RowHistory = field(init=False)  # the penalties' view of seq's token lists

    def __post_init__(self) -> None:
        # The lists themselves (they grow in place), built once rather than every step.
        self.history = RowHistory(self.seq.prompt_token_ids, self.seq.output_token_ids)


@dataclass
class _Launched:
    """A step whose forward is launched and whose tokens are not sampled yet."""

    plan: SchedulePlan
    t0_s: float  # time.monotonic() at launch
    requests: dict[str, _Request]  # the plan's, by sequence id, at launch
    lay: StepLayout | None = None
    logits: torch.Tensor | None = None  # None: the launch failed
    reqs: list[_Request] = field(default_factory=list)  # one per sampled row
    masks: torch.Tensor | None = None  # structured outputs' token masks of those rows
    weight_bytes: int = 0  # what its forward read (a MoE step reads its routed experts)
    # Asynchronous steps only: sampled ids on the device, their packed read-back (pinned,
    # in flight until `event`), and where commit_ahead put each row's placeholder.
    ids: torch.Tensor | None = None
    read_back: torch.Tensor | None = None
    event: object | None = None
    ahead_at: dict[str, int] = field(default_factory=dict)
    # The sampled rows' processed logits, when _sample_on_device made them and then left
    # the step synchronous (no device sampler): _complete samples from them.
    processed: torch.Tensor | None = None


@dataclass
class _Sampled:
    """One request's token of a completed step, between its id checks and its text."""

    req: _Request
    token: int | None
    logprob: TokenLogprob | None
    prompt_logprobs: list[TokenLogprob | None] | None
    reason: str | None = None  # decided by the token id: "stop", "length" or "error"
    error: str | None = None
    detokenize: bool = True  # False for EOS and stop token ids: their text is not output


class Engine:
    """Continuous batching over a paged KV cache on one model."""

    def __init__(
        self,
        loaded: LoadedModel,
        options: EngineOptions,
        device: torch.device | str = "cpu",
        device_ops: DeviceOps | None = None,
    ) -> None:
        """device: where weights, the KV pool, step tensors and sampling live
        (wattserve.daemon.engine.placement resolves `[engine] device` to it).
        device_ops: what moves the step's bytes (default: torch's on CUDA, a recording
        variant elsewhere; bench host passes a recording one under a fake CUDA device)."""
        if options.threads:
            torch.set_num_threads(options.threads)
        self.device = dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = self.device = torch.device("cuda", torch.cuda.current_device())
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        cfg = loaded.hf_model.config
        shape = model_shape(cfg)
        bpb = bytes_per_block(
            shape.num_layers,
            options.block_size_tokens,
            shape.num_kv_heads,
            shape.head_dim,
            loaded.dtype.itemsize,
        )
        # CPU: a share of the host memory available before the weights are built (as
        # before); CUDA: what the weights leave of gpu_memory_utilization, so after them.
        budget = options.kv_cache_bytes or (
            None if dev.type == "cuda" else _kv_budget_bytes(dev, options)
        )
        self.model = LlamaModel(loaded.hf_model, None, options.block_size_tokens, loaded.dtype, dev)
        budget = budget or _kv_budget_bytes(dev, options)
        num_blocks = budget // bpb
        if num_blocks < 1:
            raise ValueError(f"KV cache budget {budget} bytes holds no block of {bpb} bytes")
        self.model.allocate_kv_cache(num_blocks)
        self.kv_spec = KVCacheSpec(num_blocks, options.block_size_tokens, bpb)
        limit = options.max_model_len or shape.max_position_embeddings
        limit = min(limit, shape.max_position_embeddings, self.kv_spec.capacity_tokens)
        self.max_model_len = limit
        self.kv = KVCacheManager(
            num_blocks, options.block_size_tokens, options.enable_prefix_caching
        )
        self.scheduler = Scheduler(self.kv)
        self.scheduler.prefix_salt = self.model.prefix_salt
        self.scheduler.recompute_at_tokens = self.model.rope.recompute_at_tokens
        self._limits = EngineLimits(options.max_num_seqs, options.max_num_batched_tokens)
        self.eos_token_ids = _eos_ids(loaded)
        self.grammars = Grammars(self.tokenizer, shape.vocab_size, self.eos_token_ids)
        self._quant_allowed, self._quant_unavailable = _usable_levels(
            options.quantization_levels or default_levels(dev), loaded.dtype, dev
        )
        self._quant_prepare = options.quant_prepare
        start_level = options.quantization_level or self.model.full_precision_level
        self._check_quant_level(start_level)
        if options.quant_prepare == "start":
            for level in self._quant_allowed:
                self.model.prepare_level(level)
        self.model.use_level(start_level)
        self.kv.set_namespace(start_level)
        self._quant_target = start_level  # written by set_quant_level, read by the loop
        self._graphs: StepGraphs | None = None
        if options.cuda_graphs and graphs_supported(dev) and self.model.graph_capturable:
            self._graphs = StepGraphs(
                self.model,
                options.cuda_graph_max_tokens,
                options.max_num_seqs,
                options.max_num_batched_tokens,
                self.max_model_len,
            )
            self._graphs.capture_all(filter(self.model.is_prepared, self._quant_allowed))
        self._weight_bytes = self.model.weight_bytes()
        self._kv_bytes_per_token = bpb // options.block_size_tokens
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._requests: dict[str, _Request] = {}
        # Those of _requests that ask for prompt logprobs, and those with a grammar: most
        # steps have none, and then skip that work without a look at every row.
        self._prompt_logprob_ids: set[str] = set()
        self._grammar_ids: set[str] = set()
        self._overlap_detokenize = (
            options.overlap_detokenize
            if options.overlap_detokenize is not None
            else dev.type == "cuda"
        )
        self._in_flight: _Launched | None = None  # launched, not sampled yet (overlap only)
        # A length-dependent rope recomputes a sequence's KV at a length commit() sees:
        # those models step synchronously.
        self._async = (
            options.async_steps if options.async_steps is not None else dev.type == "cuda"
        ) and self.scheduler.recompute_at_tokens is None
        # Off CUDA, asynchronous steps (tests, benches) record what they would ask of a
        # device; synchronous CPU steps ask nothing of these ops (nothing is recorded).
        self.device_ops = device_ops or (
            RecordingOps(dev) if self._async and dev.type != "cuda" else DeviceOps(dev)
        )
        if dev.type != "cpu":
            self.model.set_device_ops(self.device_ops)
        self._read_backs = Ring(self.device_ops.pinned, torch.float32)
        self._param_bytes = Ring(self.device_ops.pinned, torch.uint8)  # the sampler's
        self._launches = itertools.count()
        self._hooks: list[Callable[[StepStats], None]] = []
        self._outbox: list[tuple[Sink, RequestOutput]] = []  # this step's events
        self.delivery: Delivery = call_each
        self._fault_hooks: list[Callable[[BaseException], None]] = []
        # Held while a request is queued and while the dying loop empties the queue, so
        # that no request lands in a queue that nobody will read again.
        self._intake_lock = threading.Lock()
        self.fault: BaseException | None = None  # set once, when the loop thread died
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._step_ids = itertools.count()
        self._last_step_start_s = -float("inf")
        self._last_decode_only = False
        self.counters = EngineCounters()
        self.last_step: StepStats | None = None
        log.info(
            "KV cache on %s: %d blocks x %d tokens = %d tokens, %.1f MiB; max_model_len %d; "
            "prefix caching %s; attention %s",
            dev,
            num_blocks,
            options.block_size_tokens,
            self.kv_spec.capacity_tokens,
            self.kv_spec.total_bytes / 2**20,
            self.max_model_len,
            "on" if options.enable_prefix_caching else "off",
            self.model.attention_backend,
        )
        log.info(
            "quantization: level %s; allowed %s; weight MiB per level (prepare=%s): %s%s",
            start_level,
            ", ".join(self._quant_allowed),
            options.quant_prepare,
            ", ".join(
                f"{lvl} {self.model.level_bytes(lvl) / 2**20:.1f}"
                + ("" if self.model.is_prepared(lvl) else " (not built yet)")
                for lvl in self._quant_allowed
            ),
            "".join(f"; {why}" for why in self._quant_unavailable.values()),
        )

    # ---- knobs -----------------------------------------------------------------
    @property
    def limits(self) -> EngineLimits:
        return self._limits

    def set_limits(
        self,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        decode_interval_ms: float | None = None,
    ) -> EngineLimits:
        """The controller's batch and pacing actuator; takes effect at the next step.
        Drops nothing. decode_interval_ms: a decode-only step starts no sooner than this
        after the step before while no request waits (an arrival ends the wait); 0: off."""
        old = self._limits
        new = EngineLimits(
            max_num_seqs if max_num_seqs is not None else old.max_num_seqs,
            max_num_batched_tokens
            if max_num_batched_tokens is not None
            else old.max_num_batched_tokens,
            decode_interval_ms if decode_interval_ms is not None else old.decode_interval_ms,
        )
        self._limits = new  # one reference swap: atomic for the loop thread
        return new

    @property
    def quant_level(self) -> str:
        """The level the model runs at now (a requested switch lands at the next step)."""
        return self.model.level

    def set_quant_level(self, level: str) -> str:
        """The controller's quantization actuator; takes effect at the next step.

        The KV cache and running sequences stay as they are. A level not built yet is
        built first, on the caller's thread (seconds on a real model: call it from a
        worker thread, not an event loop). Raises QuantLevelError for an unknown level
        or one outside `quantization_levels` / unavailable on this device.
        """
        self._check_quant_level(level)
        self.model.prepare_level(level)
        self._quant_target = level  # one reference swap: atomic for the loop thread
        return level

    def quant_status(self) -> dict:
        """Quantization state for /v1/status: active and requested level, allowed
        levels with their weight bytes (measured once built, computed before)."""
        return {
            "level": self.model.level,
            "requested": self._quant_target,
            "full_precision": self.model.full_precision_level,
            "prepare": self._quant_prepare,
            "levels": {
                lvl: {
                    "weight_bytes": self.model.level_bytes(lvl),
                    "prepared": self.model.is_prepared(lvl),
                }
                for lvl in self._quant_allowed
            },
            "unavailable": dict(self._quant_unavailable),
        }

    def _check_quant_level(self, level: str) -> None:
        parse_level(level)  # unknown names raise with the list of known ones
        if level in self._quant_allowed:
            return
        why = self._quant_unavailable.get(level, "not listed in engine.quantization_levels")
        raise QuantLevelError(
            f"quantization level {level!r} is not allowed: {why} "
            f"(allowed: {', '.join(self._quant_allowed)})"
        )

    def _apply_quant_level(self) -> None:
        target = self._quant_target
        if target != self.model.level:
            previous = self.model.level
            self.model.use_level(target)
            self.kv.set_namespace(target)  # cached KV of the old level is not reused
            self._weight_bytes = self.model.weight_bytes()
            log.info("quantization level %s -> %s", previous, target)

    def set_delivery(self, delivery: Delivery) -> None:
        """delivery(batch) receives each step's events at the end of that step (and
        those of aborts and failures outside a step), on the engine's loop thread."""
        self.delivery = delivery

    def _send(self, sink: Sink, out: RequestOutput) -> None:
        self._outbox.append((sink, out))

    def _flush(self) -> None:
        """Hand this step's events to the delivery function in one call."""
        if not self._outbox:
            return
        batch, self._outbox = self._outbox, []
        try:
            self.delivery(batch)
        except Exception:  # a consumer's bug must not stop the step loop
            log.exception("delivering %d request events failed", len(batch))

    def add_step_hook(self, hook: Callable[[StepStats], None]) -> None:
        """hook(stats) runs on the loop thread after every step; it may sleep (virtual GPU)."""
        self._hooks.append(hook)

    # ---- intake (any thread) -------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt, add_special_tokens=False))

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        sink: Sink,
        request_id: str | None = None,
    ) -> str:
        """Validate and queue a request; raises InvalidRequestError naming the parameter."""
        params.validate()
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", param="prompt")
            ids = self.tokenize(prompt)
        else:
            ids = list(prompt)
            vocab = self.model.shape.vocab_size
            if any(
                isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids
            ):
                raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
        if not ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        vocab = self.model.shape.vocab_size
        if any(t >= vocab for t, _ in params.logit_bias):
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab})", "logit_bias")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; this model's context is {self.max_model_len}",
                param="prompt",
                code="context_length_exceeded",
            )
        if len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"context of {self.max_model_len} tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        rid = request_id or uuid.uuid4().hex
        req = _Request(
            seq=Sequence(
                rid,
                ids,
                priority=params.priority,
                reuse_cached_prefix=params.prompt_logprobs is None,
            ),
            params=params,
            sink=sink,
            detok=IncrementalDetokenizer(
                self.tokenizer,
                ids,
                params.stop,
                include_stop=params.include_stop_str_in_output,
                skip_special_tokens=params.skip_special_tokens,
            ),
            # greedy rows draw nothing (and a fake CUDA device has no generator)
            generator=None if params.greedy else make_generator(params.seed, self.device),
            arrival_s=time.monotonic(),
            grammar=None if params.guided is None else self.grammars.state(params.guided),
        )
        with self._intake_lock:
            if self.fault is None:
                self._inbox.put(("add", req))
                return rid
        self._fail(req, ENGINE_FAULT_MESSAGE)  # the loop is gone: end it now, not never
        return rid

    def abort(self, request_id: str) -> None:
        """Abort from any thread; its blocks are freed at the top of the next step."""
        self._inbox.put(("abort", request_id))

    # ---- the loop ------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def oldest_waiting_s(self) -> float | None:
        """How long the oldest request in the waiting queue has waited since it arrived
        (None: none waits). Any thread: a snapshot of the scheduler's queue."""
        now = time.monotonic()
        requests = [self._requests.get(s.seq_id) for s in list(self.scheduler.waiting)]
        return max((now - r.arrival_s for r in requests if r is not None), default=None)

    def has_work(self) -> bool:
        return bool(self._requests) or self._in_flight is not None or not self._inbox.empty()

    def _drain_inbox(self, block_s: float, aborts: list[str] | None = None) -> None:
        """Take queued requests and aborts; with `aborts` (a step's text still to be made),
        an aborted request leaves the scheduler now and its id goes there, for _finish
        after that step's events."""
        try:
            item = self._inbox.get(timeout=block_s) if block_s > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "add":
                self._requests[payload.seq.seq_id] = payload
                if payload.params.prompt_logprobs is not None:
                    self._prompt_logprob_ids.add(payload.seq.seq_id)
                if payload.grammar is not None:
                    self._grammar_ids.add(payload.seq.seq_id)
                self.scheduler.add(payload.seq)
                self.counters.prompt_tokens += len(payload.seq.prompt_token_ids)
            elif kind == "abort" and aborts is not None:
                # Its blocks are freed and it is not scheduled again now; its event waits
                # until the completed step's tokens are out.
                aborts.append(payload)
                if payload in self._requests:
                    self.scheduler.finish(payload)
            elif kind == "abort" and payload in self._requests:
                self._finish(self._requests[payload], "abort")
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def step(self, block_s: float = 0.0) -> StepStats | None:
        """Run one engine iteration; returns None when there was nothing to compute.
        Its events (tokens, finishes, aborts) are delivered together at its end. With
        overlap_detokenize the next step's forward is launched before this one's text is
        made, and stays in flight when step() returns (the next call samples it)."""
        try:
            return self._step(block_s)
        finally:
            self._flush()

    def _step(self, block_s: float) -> StepStats | None:
        launched = self._in_flight or self._launch(block_s)
        self._in_flight = None
        if launched is None:
            return None
        aborts: list[str] = []
        if launched.event is not None:
            # Asynchronous: step N+1 is launched (its decodes' input ids taken from N's
            # sampled ids on the device) before N's read-back is waited on.
            self._in_flight = self._launch(0.0, aborts, prev=launched)
            rows = self._complete(launched)
        else:
            rows = self._complete(launched)
            if rows is not None and self._overlap_detokenize:
                # The device computes step N+1 while the host makes step N's text below.
                self._in_flight = self._launch(0.0, aborts)
        if rows is None:
            self._finish_aborts(aborts)
            return None
        now = time.monotonic()
        finished = sum(row.reason is not None for row in rows)
        finished += self._emit(rows)
        self._finish_aborts(aborts)
        stats = self._step_stats(launched, now - launched.t0_s, finished)
        for hook in self._hooks:
            hook(stats)
        return stats

    def _finish_aborts(self, aborts: list[str]) -> None:
        for rid in aborts:  # after the step's tokens: an abort's event ends its stream
            if rid in self._requests:
                self._finish(self._requests[rid], "abort")

    def _launch(
        self, block_s: float, aborts: list[str] | None = None, prev: _Launched | None = None
    ) -> _Launched | None:
        """Schedule a step and launch its forward (on a GPU it runs on while the host goes
        on). aborts: given while a completed step's text is still to be made (see
        _drain_inbox); decode pacing then launches nothing rather than wait. prev: the
        asynchronous step whose read-back is still in flight (its ids feed this one)."""
        overlapped = aborts is not None
        self._drain_inbox(0.0 if self._requests or overlapped else block_s, aborts)
        pause_s = self.pacing_wait_s()
        if pause_s > 0:
            # Decode pacing: idle until the interval is up; an arrival ends the wait at
            # once (the next call finds it waiting). Short waits keep stop() responsive.
            if not overlapped:
                self._drain_inbox(min(pause_s, 0.05))
            return None
        self._apply_quant_level()
        plan = self.scheduler.schedule(self._limits)
        if plan.is_empty:
            return None
        t0 = time.monotonic()
        self._last_step_start_s = t0
        self._last_decode_only = all(c.num_tokens == 1 for c in plan.chunks)
        step = _Launched(
            plan, t0, {c.seq.seq_id: self._requests[c.seq.seq_id] for c in plan.chunks}
        )
        try:
            lay = self.model.layout(plan.chunks, self.kv.tables, self._prompt_logits_wanted(plan))
            carry = self._carried_ids(plan, lay, prev)
            logits = self._graphs.run(lay, carry) if self._graphs is not None else None
            if logits is None:  # no graph for this step (or none at all): eager
                inputs = self.model.inputs_from(lay)
                if carry is not None:
                    carry(inputs)
                logits = self.model.forward(inputs)
            step_no = next(self._launches)
            self.device_ops.launched(step_no)
            step.weight_bytes = self.model.step_weight_bytes(self._weight_bytes)
            reqs = [step.requests[c.seq.seq_id] for c in lay.sampled_chunks]
            step.lay, step.logits, step.reqs = lay, logits, reqs
            if self._async and not lay.prompt_logit_chunks:
                self._sample_on_device(step, step_no)
            if step.event is None and self._grammar_ids:
                # Before the logits are read: on a GPU this overlaps the forward still running.
                step.masks = self.grammars.fill_masks([r.grammar for r in reqs])
        except Exception:  # a bug in one batch must not take the daemon down
            log.exception("engine step failed; failing the %d requests in it", len(plan.chunks))
            step.logits = None
            return step  # no logits: its requests fail when it is completed
        return step

    def _carried_ids(
        self, plan: SchedulePlan, lay: StepLayout, prev: _Launched | None
    ) -> Callable[[StepInputs], None] | None:
        """What puts prev's sampled ids on the device into this step's input ids, for the
        decodes whose last token is still a placeholder (None: none is)."""
        if prev is None or prev.ids is None:
            return None
        src_of = {r.seq.seq_id: i for i, r in enumerate(prev.reqs)}
        dst, src = [], []
        for i, c in enumerate(plan.chunks):
            if c.seq.num_ahead and c.start == c.seq.num_tokens - 1:
                dst.append(lay.query_start[i])
                src.append(src_of[c.seq.seq_id])  # KeyError: a bug, the step fails
        if not dst:
            return None
        ids = prev.ids

        def carry(inputs: StepInputs) -> None:
            idx = self.model.to_device(dst + src)
            rows, from_rows = idx.split([len(dst), len(src)])
            inputs.input_ids.index_copy_(0, rows, ids.index_select(0, from_rows))

        return carry

    def _upload_params(self, host: torch.Tensor) -> torch.Tensor:
        """The device sampler's parameter bytes, through a pinned buffer (one upload)."""
        return self.device_ops.upload(self._param_bytes.take(host.numel()).copy_(host))

    def _sample_on_device(self, step: _Launched, step_no: int) -> None:
        """Choose an asynchronous step's tokens on the device and start their read-back,
        or leave the step to _complete (synchronous) when a row needs host state built
        from the step before (grammar masks, penalties over output ids) or a sampler the
        device has not got (device_ids returns None)."""
        reqs = step.reqs
        if not reqs or any(r.grammar is not None or r.params.penalized for r in reqs):
            return  # nothing sampled, or a row needs host state: synchronous
        params = [r.params for r in reqs]
        # narrow, not [:n]: Python indexing of a device tensor needs its library, which a
        # fake CUDA device on a CPU-only torch has not got (as in the sampler)
        rows = step.logits.narrow(0, 0, len(reqs))
        processed = process(rows, params, [r.history for r in reqs], self.eos_token_ids)
        ids = device_ids(processed, params, _positions(step), self._upload_params)
        if ids is None:
            step.processed = processed
            return
        packed = packed_read_back(processed, ids, params)
        step.read_back = self._read_backs.take(packed.numel())
        self.device_ops.read_back(packed, step.read_back)
        step.event = self.device_ops.record_event(step_no)
        step.ids = ids
        step.ahead_at = self.scheduler.commit_ahead(step.plan)

    def _complete(self, step: _Launched) -> list[_Sampled] | None:
        """Sample a launched step (the one read-back), commit it and check each token's
        id for a finish (EOS, stop ids, grammar, length); a request so finished leaves
        the scheduler now, before the next step is scheduled. Text and stop strings
        wait for _emit. None when the step failed (its requests ended with an error)."""
        if step.logits is None:  # its launch failed (logged then)
            self._fail_step(step.plan)
            return None
        if step.event is not None:
            return self._complete_async(step)
        reqs, logits = step.reqs, step.logits
        try:
            self._gather_prompt_logprobs(step.lay, logits[len(reqs) :], step.requests)
            params = [r.params for r in reqs]
            processed = step.processed
            if processed is None:
                history = [r.history for r in reqs]
                processed = process(logits[: len(reqs)], params, history, self.eos_token_ids)
            processed = apply_masks(processed, step.masks)
            tokens = self._sample_sync(step, processed, params)
            logprobs = _sampled_logprobs(processed, params, tokens)
        except Exception:  # a bug in one batch must not take the daemon down
            log.exception(
                "engine step failed; failing the %d requests in it", len(step.plan.chunks)
            )
            self._fail_step(step.plan)
            return None
        # A request that finished while its step was in flight (a stop string found in the
        # step before's text, an abort) drops its token: never committed nor delivered.
        live = [
            (r, t, lp)
            for r, t, lp in zip(reqs, tokens, logprobs, strict=True)
            if self._requests.get(r.seq.seq_id) is r
        ]
        self.scheduler.commit(step.plan, {r.seq.seq_id: t for r, t, _ in live if t is not None})
        now = time.monotonic()
        rows = [self._check_token(r, t, lp, now) for r, t, lp in live]
        for row in rows:
            if row.reason is not None:
                self._retire(row.req)
        return rows

    def _sample_sync(
        self, step: _Launched, processed: torch.Tensor, params: list[SamplingParams]
    ) -> list[int | None]:
        """A synchronous step's tokens. Sampled rows draw where an asynchronous step's
        would (the device sampler, where it runs), so a seed fixes a request's tokens
        whether or not a grammar or penalised row made its step synchronous."""
        ids = None
        if not all(p.greedy for p in params):
            ids = device_ids(processed, params, _positions(step), self._upload_params)
        if ids is None:
            return sample(processed, params, [r.generator for r in step.reqs])
        return [None if t < 0 else t for t in ids.tolist()]

    def _complete_async(self, step: _Launched) -> list[_Sampled]:
        """_complete for a step committed ahead: wait for its read-back, put each token in
        its placeholder's place, check each for a finish. A request that finished while
        the step was in flight (a stop found one step late, an abort) drops its token."""
        self.device_ops.wait(step.event)
        reqs = step.reqs
        values = self.device_ops.values(step.read_back)
        tokens, logprobs = unpack(values, [r.params for r in reqs])
        now = time.monotonic()
        rows = []
        for r, t, lp in zip(reqs, tokens, logprobs, strict=True):
            seq = r.seq
            if self._requests.get(seq.seq_id) is not r:
                continue  # ended since: its token is never delivered nor counted
            at = step.ahead_at.get(seq.seq_id)
            if at is None:  # not running when the step was committed (preempted)
                continue
            self.scheduler.settle(seq, at, t)
            ahead = len(seq.output_token_ids) - at - 1  # the next step's placeholder
            rows.append(self._check_token(r, t, lp, now, ahead))
        for row in rows:
            if row.reason is not None:
                seq = row.req.seq
                # The next step's token of a finished request is dropped.
                del seq.output_token_ids[len(seq.output_token_ids) - seq.num_ahead :]
                seq.num_ahead = 0
                self._retire(row.req)
        return rows

    def _prompt_logits_wanted(self, plan: SchedulePlan) -> frozenset[str]:
        """Sequences whose chunk this step covers prompt positions not gathered yet."""
        if not self._prompt_logprob_ids:
            return frozenset()  # no request asks for prompt logprobs: the common case
        wanted = []
        for c in plan.chunks:
            req = self._requests[c.seq.seq_id]
            if (
                req.params.prompt_logprobs is not None
                and len(req.prompt_logprobs) == c.start + 1
                and c.start < len(c.seq.prompt_token_ids) - 1
            ):
                wanted.append(c.seq.seq_id)
        return frozenset(wanted)

    def _gather_prompt_logprobs(
        self, lay: StepLayout, logits: torch.Tensor, requests: dict[str, _Request]
    ) -> None:
        """logits: the rows prepare() added for prompt logprobs, chunk after chunk;
        requests: the step's, by sequence id, as it was launched."""
        # A chunk recomputed after preemption finds its positions gathered already and is
        # not asked for (_prompt_logits_wanted); one that skips positions is not either.
        row = 0
        for chunk, rows_n in lay.prompt_logit_chunks:
            req = requests[chunk.seq.seq_id]
            prompt = chunk.seq.prompt_token_ids
            if rows_n:
                targets = prompt[chunk.start + 1 : chunk.start + 1 + rows_n]
                k = req.params.prompt_logprobs or 0
                req.prompt_logprobs.extend(
                    logprobs_of(logits[row : row + rows_n], targets, [k] * rows_n)
                )
            row += rows_n

    def pacing_wait_s(self) -> float:
        """How long decode pacing holds the next step back now (0: not pacing): only after
        a decode-only step, and only while no request waits."""
        interval_ms = self._limits.decode_interval_ms
        if interval_ms <= 0 or not self._last_decode_only or self.scheduler.waiting:
            return 0.0
        return max(0.0, self._last_step_start_s + interval_ms / 1000.0 - time.monotonic())

    def _step_stats(self, step: _Launched, dt: float, finished: int) -> StepStats:
        plan, t0 = step.plan, step.t0_s
        decode = sum(1 for c in plan.chunks if c.num_tokens == 1)
        prefill = plan.num_tokens - decode
        ctx = sum(c.start + c.num_tokens for c in plan.chunks)
        self.counters.steps += 1
        self.counters.preemptions += len(plan.preempted)
        self.counters.prefix_cache_queried_tokens += plan.prefix_queried_tokens
        self.counters.prefix_cache_hit_tokens += plan.prefix_hit_tokens
        stats = StepStats(
            step=next(self._step_ids),
            started_at_s=t0,
            duration_s=dt,
            prefill_tokens=prefill,
            decode_tokens=decode,
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            kv_blocks_used=self.kv.num_used_blocks,
            kv_blocks_total=self.kv.num_blocks,
            num_preempted=len(plan.preempted),
            num_finished=finished,
            weight_bytes=step.weight_bytes or self._weight_bytes,
            kv_bytes_read=ctx * self._kv_bytes_per_token,
            quant_level=self.model.level,
        )
        self.last_step = stats
        return stats

    def _fail_step(self, plan: SchedulePlan) -> None:
        for c in plan.chunks:
            if c.seq.seq_id in self._requests:
                self._finish(self._requests[c.seq.seq_id], "error", "internal engine error")

    def _check_token(
        self,
        req: _Request,
        token: int | None,
        lp: TokenLogprob | None,
        now: float,
        ahead: int = 0,
    ) -> _Sampled:
        """The finish a sampled token decides by its id alone (None: its text may).
        ahead: tokens after it already committed ahead (asynchronous steps)."""
        seq, p = req.seq, req.params
        if token is None:
            return _Sampled(req, None, None, None, "error", "non-finite logits")
        prompt_lps = None
        if req.first_token_s is None:
            req.first_token_s = now
            if p.prompt_logprobs is not None:
                prompt_lps = req.prompt_logprobs
                if len(prompt_lps) != len(seq.prompt_token_ids):
                    # Positions never computed (a KV cache that skipped them): say so,
                    # rather than hand back a shorter list as if it were whole.
                    return _Sampled(
                        req, None, None, None, "error", "prompt logprobs are incomplete"
                    )
        self.counters.generation_tokens += 1
        if req.grammar is not None and not req.grammar.advance(token):
            return _Sampled(
                req, None, None, None, "error", "the sampled token does not fit the grammar"
            )
        row = _Sampled(req, token, lp, prompt_lps)
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            row.reason, row.detokenize = "stop", False  # its text is not the request's
        elif req.grammar is not None and req.grammar.terminated:
            row.reason = "stop"  # after its text: the token that completed the grammar is kept
        elif (
            len(seq.output_token_ids) - ahead >= p.max_tokens
            or seq.num_tokens - ahead >= self.max_model_len
        ):
            row.reason = "length"
        return row

    def _emit(self, rows: list[_Sampled]) -> int:
        """Detokenize a completed step's tokens, match stop strings and send its events;
        returns how many requests a stop string finished (_check_token's count apart)."""
        stopped = 0
        requests, send = self._requests, self._outbox.append  # what _send does, per row
        for row in rows:
            req = row.req
            reason = row.reason
            if reason == "error":
                self._finish(req, "error", row.error)
                continue
            seq = req.seq
            if reason is None:
                if requests.get(seq.seq_id) is not req:
                    continue  # ended since its token was sampled (its end was sent then)
                text = req.detok.step(row.token)  # type: ignore[arg-type]
                if text is None:
                    stopped += 1
                    reason = "stop"
            elif row.detokenize and req.detok.add(row.token):  # type: ignore[arg-type]
                reason = "stop"  # a stop string outranks a length finish, as it ends first
            if reason is not None:
                self._finish(
                    req,
                    reason,
                    last_token=row.token,
                    last_logprob=row.logprob,
                    prompt_logprobs=row.prompt_logprobs,
                )
                continue
            lp = row.logprob
            send(
                (
                    req.sink,
                    RequestOutput(
                        seq.seq_id,
                        [row.token],  # type: ignore[list-item]
                        text,
                        prompt_tokens=len(seq.prompt_token_ids),
                        completion_tokens=seq.num_output_known,
                        logprobs=None if lp is None else [lp],
                        prompt_logprobs=row.prompt_logprobs,
                    ),
                )
            )
        return stopped

    def _retire(self, req: _Request) -> None:
        """Take a request out of the scheduler (its KV blocks are freed) and the loop."""
        if self._requests.get(req.seq.seq_id) is req:
            self.scheduler.finish(req.seq.seq_id)
            del self._requests[req.seq.seq_id]
            self._prompt_logprob_ids.discard(req.seq.seq_id)
            self._grammar_ids.discard(req.seq.seq_id)

    def _finish(
        self,
        req: _Request,
        reason: str,
        error: str | None = None,
        last_token: int | None = None,
        last_logprob: TokenLogprob | None = None,
        prompt_logprobs: list[TokenLogprob | None] | None = None,
    ) -> None:
        seq = req.seq
        self._retire(req)
        self.counters.requests_finished[reason] += 1
        text = req.detok.take(final=True) if reason != "error" else ""
        self._send(
            req.sink,
            RequestOutput(
                seq.seq_id,
                [last_token] if last_token is not None else [],
                text,
                finished=True,
                finish_reason=reason,
                error=error,
                prompt_tokens=len(seq.prompt_token_ids),
                completion_tokens=seq.num_output_known,
                logprobs=None if last_logprob is None else [last_logprob],
                prompt_logprobs=prompt_logprobs,
            ),
        )

    # ---- threads ---------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("engine already started")
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="wattserve-engine", daemon=True)
        self._thread.start()

    def add_fault_hook(self, hook: Callable[[BaseException], None]) -> None:
        """hook(error) runs once on the loop thread if the loop dies, after every request
        it held has ended with finish_reason "error"."""
        self._fault_hooks.append(hook)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.step(block_s=0.05)
        except BaseException as e:  # noqa: BLE001 - a dead loop must never be silent
            self._die(e)

    def _die(self, error: BaseException) -> None:
        """The loop raised outside a batch's forward (scheduler, commit, hooks): its state
        cannot be trusted, so nothing here touches the scheduler or the KV cache again."""
        log.critical("engine loop died: %s", error, exc_info=error)
        with self._intake_lock:
            self.fault = error
            pending = list(self._requests.values())
            self._requests.clear()
            while True:
                try:
                    kind, payload = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "add":
                    pending.append(payload)
        for req in pending:
            self._fail(req, ENGINE_FAULT_MESSAGE)
        self._flush()
        for hook in self._fault_hooks:
            try:
                hook(error)
            except Exception:
                log.exception("engine fault hook failed")

    def _fail(self, req: _Request, error: str) -> None:
        """End a request with an error without the scheduler (the loop is gone)."""
        seq = req.seq
        self.counters.requests_finished["error"] += 1
        self._send(
            req.sink,
            RequestOutput(
                seq.seq_id,
                [],
                "",
                finished=True,
                finish_reason="error",
                error=error,
                prompt_tokens=len(seq.prompt_token_ids),
                completion_tokens=seq.num_output_known,
            ),
        )

    def stop(self, abort_pending: bool = True, timeout_s: float = 10.0) -> None:
        """Stop the loop thread; pending requests are aborted (their sinks hear it)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout_s)
            self._thread = None
        self._in_flight = None  # its tokens are dropped with its requests
        if abort_pending:
            self._drain_inbox(0.0)
            for req in list(self._requests.values()):
                self._finish(req, "abort")
            self._flush()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- offline use (bench, tests) ---------------------------------------------------
    def generate(
        self, prompts: Iterable[str | list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[RequestOutput]:
        """Run prompts to completion on the caller's thread; one merged output each."""
        if self.is_running:
            raise RuntimeError("generate() drives the loop itself; the engine thread is running")
        prompts = list(prompts)
        plist = params if isinstance(params, list) else [params] * len(prompts)
        merged: dict[str, RequestOutput] = {}
        order = []
        for prompt, p in zip(prompts, plist, strict=True):
            rid = self.add_request(prompt, p, lambda out: _merge(merged, out))
            order.append(rid)
        while self.has_work():
            self.step()
        return [merged[rid] for rid in order]


def _positions(step: _Launched) -> list[int]:
    """Each sampled row's Philox counter for the device sampler: the position of the token
    it chooses (so a seeded request's draws depend on nothing else in its step)."""
    return [c.start + c.num_tokens for c in step.lay.sampled_chunks]


def _sampled_logprobs(
    logits: torch.Tensor, params: list[SamplingParams], tokens: list[int | None]
) -> list[TokenLogprob | None]:
    """The sampled tokens' logprobs for the rows that asked; None for the others."""
    rows = [
        i
        for i, (p, t) in enumerate(zip(params, tokens, strict=True))
        if p.logprobs is not None and t is not None
    ]
    out: list[TokenLogprob | None] = [None] * len(params)
    if rows:
        idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
        computed = logprobs_of(
            logits.index_select(0, idx),
            [tokens[i] for i in rows],  # type: ignore[misc]
            [params[i].logprobs or 0 for i in rows],
        )
        for i, lp in zip(rows, computed, strict=True):
            out[i] = lp
    return out


def _merge(into: dict[str, RequestOutput], out: RequestOutput) -> None:
    acc = into.setdefault(out.request_id, RequestOutput(out.request_id))
    acc.token_ids.extend(out.token_ids)
    if out.logprobs is not None:
        acc.logprobs = (acc.logprobs or []) + out.logprobs
    if out.prompt_logprobs is not None:
        acc.prompt_logprobs = out.prompt_logprobs
    acc.text += out.text
    acc.finished, acc.finish_reason, acc.error = out.finished, out.finish_reason, out.error
    acc.prompt_tokens, acc.completion_tokens = out.prompt_tokens, out.completion_tokens


def _kv_budget_bytes(device: torch.device, options: EngineOptions) -> int:
    """KV pool bytes when kv_cache_bytes is unset. CUDA: gpu_memory_utilization of the
    GPU's memory less what is in use now (the weights, other processes), as vLLM sizes it;
    CPU: kv_cache_memory_fraction of the host memory available now."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * options.gpu_memory_utilization) - (total - free)
        log.info(
            "%s: %.1f of %.1f GiB free; gpu_memory_utilization %.2f leaves %.1f GiB for KV",
            device,
            free / 2**30,
            total / 2**30,
            options.gpu_memory_utilization,
            max(budget, 0) / 2**30,
        )
        return max(budget, 0)
    return int(psutil.virtual_memory().available * options.kv_cache_memory_fraction)


def _usable_levels(
    configured: Iterable[str], loaded_dtype: torch.dtype, device: torch.device
) -> tuple[tuple[str, ...], dict[str, str]]:
    """Split configured levels into those this engine can run and {level: why not}."""
    usable: list[str] = []
    unusable: dict[str, str] = {}
    for level in configured:
        why = level_unavailable_reason(level, loaded_dtype, device)
        if why is None:
            usable.append(level)
        else:
            unusable[level] = why
    return tuple(dict.fromkeys(usable)), unusable


def _eos_ids(loaded: LoadedModel) -> frozenset[int]:
    ids: set[int] = set()
    for source in (
        loaded.tokenizer.eos_token_id,
        getattr(loaded.hf_model, "generation_config", None),
    ):
        value = getattr(source, "eos_token_id", source)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)
