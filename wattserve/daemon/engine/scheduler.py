"""Waiting and running queues: admission, chunked prefill, preemption by recompute.

Plain Python over plain data (no torch): schedule() turns the queues into a batch plan
for one model step, and commit() records what that step computed. It must not sample,
detokenize or decide when a request is finished; the engine does that and calls finish().
"""

from __future__ import annotations

import bisect
import enum
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from wattserve.daemon.engine.kv_cache import KVCacheManager

# The longest decode pacing interval the engine takes. While pacing and with nothing
# waiting it steps only this often, and the systemd watchdog (a ping at half WatchdogSec,
# only after engine progress) must see a step between any two pings: keep it far below.
DECODE_INTERVAL_MAX_MS = 1000.0
# The output token id of a step committed ahead of its read-back (commit_ahead), until
# settle() writes the sampled id; never fed to the model (its input comes from the device).
PLACEHOLDER = -1


@dataclass(frozen=True)
class EngineLimits:
    """The step knobs, read once at the top of each step: the batch caps (schedule()) and
    decode pacing (the engine's loop: a decode-only step no sooner than decode_interval_ms
    after the step before while no request waits; 0: off)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    decode_interval_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if not 0 <= self.decode_interval_ms <= DECODE_INTERVAL_MAX_MS:
            raise ValueError(
                f"decode_interval_ms must be within [0, {DECODE_INTERVAL_MAX_MS:g}] ms "
                f"(the watchdog needs steps), got {self.decode_interval_ms!r}"
            )


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_arrivals = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One request's tokens and progress. Lower `priority` values are served first."""

    seq_id: str
    prompt_token_ids: list[int]
    priority: int = 0
    arrival: int = field(default_factory=lambda: next(_arrivals))
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING
    num_preemptions: int = 0
    # False for a request that needs every prompt position computed (prompt logprobs):
    # admission then takes no cached blocks for it.
    reuse_cached_prefix: bool = True
    # Tokens at the end of output_token_ids committed ahead of their read-back
    # (Scheduler.commit_ahead): placeholders until settle() puts the sampled id there.
    num_ahead: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_known(self) -> int:
        """Output tokens whose ids are known (those committed ahead apart)."""
        return len(self.output_token_ids) - self.num_ahead

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]


class ScheduledChunk(NamedTuple):
    """Compute tokens [start, start + num_tokens) of seq; sample after it if `samples`.
    (Immutable as a frozen dataclass is, and made once per sequence a step at a third
    of its cost.)"""

    seq: Sequence
    start: int
    num_tokens: int
    samples: bool


@dataclass
class SchedulePlan:
    chunks: list[ScheduledChunk]
    preempted: list[Sequence]
    # Prefix cache, over this step's admissions: tokens looked up, and found cached.
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    """FCFS-with-priority scheduler over a paged KV cache.

    NOTE: each step has a token budget (max_num_batched_tokens) and a sequence cap
    (max_num_seqs). Running sequences are served first, decodes (one token each) before
    unfinished prefills, so a long prompt never stalls the tokens of others: a prompt is
    fed in chunks of whatever budget is left (chunked prefill). Waiting sequences are
    admitted, best priority then oldest first, while budget, cap and free blocks allow.
    When the pool runs out of blocks, the worst running sequence (lowest priority,
    newest) is preempted: its blocks are freed and it rejoins the waiting queue at its
    original place with its generated tokens kept; on readmission prompt + output are
    recomputed, so its continuation is the one it would have produced uninterrupted.
    Lowering the cap below the running count preempts the same way; nothing is dropped.
    With prefix caching, an admitted sequence first takes the cached full blocks its
    tokens start with (shared, never written again) and is charged only the tokens after
    them; each block a step fills is registered for later sequences (commit()). A
    preempted sequence finds its own blocks again this way unless they were evicted.
    """

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []  # sorted by sort_key
        self._by_id: dict[str, Sequence] = {}
        self.num_preemptions_total = 0
        # Set by the engine from the model (a length-dependent rope): what a sequence's
        # cached KV depends on besides its tokens, and the length at which its whole KV
        # is recomputed (Phi-3's longrope switching to its long factors).
        self.prefix_salt: Callable[[Sequence], bytes] = lambda seq: b""
        self.recompute_at_tokens: int | None = None

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, seq_id: str) -> Sequence | None:
        return self._by_id.get(seq_id)

    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self._by_id:
            raise ValueError(f"duplicate sequence id {seq.seq_id!r}")
        self._by_id[seq.seq_id] = seq
        seq.status = SeqStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def finish(self, seq_id: str) -> Sequence | None:
        """Remove a sequence wherever it is and free its blocks (finish or abort)."""
        seq = self._by_id.pop(seq_id, None)
        if seq is None:
            return None
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        self.kv.free(seq_id)
        return seq

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.num_preemptions_total += 1
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def schedule(self, limits: EngineLimits) -> SchedulePlan:
        budget = limits.max_num_batched_tokens
        preempted: list[Sequence] = []
        while len(self.running) > limits.max_num_seqs:
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)

        chunks: list[ScheduledChunk] = []
        scheduled: set[str] = set()
        # (sequence, tokens it has not computed), decodes (one token) before prefills
        pending = [
            (s, len(s.prompt_token_ids) + len(s.output_token_ids) - s.num_computed_tokens)
            for s in self.running
        ]
        order = [p for p in pending if p[1] == 1] + [p for p in pending if p[1] > 1]
        allocate, running = self.kv.allocate, SeqStatus.RUNNING
        for seq, left in order:
            if budget == 0:
                break
            if seq.status is not running:
                continue  # preempted earlier in this loop
            n = min(left, budget)
            start = seq.num_computed_tokens
            while not allocate(seq.seq_id, start + n):
                victim = next(s for s in reversed(self.running) if s.seq_id not in scheduled)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            chunks.append(ScheduledChunk(seq, start, n, n == left))
            scheduled.add(seq.seq_id)
            budget -= n

        # Admit only when nothing had to be preempted: the pool is tight otherwise.
        plan_queried = plan_hits = 0
        while not preempted and self.waiting and budget > 0:
            if len(self.running) >= limits.max_num_seqs:
                break
            seq = self.waiting[0]
            prefix = (
                self.kv.match(seq.token_ids(0, seq.num_tokens), self.prefix_salt(seq))
                if seq.reuse_cached_prefix
                else None
            )
            start = prefix.num_tokens if prefix is not None else 0
            n = min(seq.num_tokens - start, budget)
            if not self.kv.allocate(seq.seq_id, start + n, prefix):
                break
            self.waiting.pop(0)
            seq.status = SeqStatus.RUNNING
            seq.num_computed_tokens = start
            bisect.insort(self.running, seq, key=lambda s: s.sort_key)
            chunks.append(ScheduledChunk(seq, start, n, start + n == seq.num_tokens))
            budget -= n
            if self.kv.enable_prefix_caching:
                plan_queried += seq.num_tokens
                plan_hits += start
        return SchedulePlan(chunks, preempted, plan_queried, plan_hits)

    def commit(self, plan: SchedulePlan, sampled: dict[str, int]) -> None:
        """Record a finished step: advance computed counts, register the blocks it filled
        in the prefix cache, append sampled tokens."""
        kv = self.kv
        bs, caching, recompute_at = (
            kv.block_size,
            kv.enable_prefix_caching,
            self.recompute_at_tokens,
        )
        running = SeqStatus.RUNNING
        for seq, start, num_tokens, samples in plan.chunks:
            if seq.status is not running:
                continue  # finished or aborted while the step ran
            seq.num_computed_tokens = start + num_tokens
            if caching:
                done = kv.num_cached_blocks(seq.seq_id)
                full = seq.num_computed_tokens // bs
                if full > done:
                    kv.cache_full_blocks(
                        seq.seq_id, seq.token_ids(done * bs, full * bs), self.prefix_salt(seq)
                    )
            token = sampled.get(seq.seq_id)
            if samples and token is not None:
                seq.output_token_ids.append(token)
                if recompute_at is not None and seq.num_tokens == recompute_at:
                    # Its KV so far was computed under the old rope: recompute it all,
                    # in the next steps' prefill budget, as transformers' generate does.
                    self.kv.free(seq.seq_id)
                    seq.num_computed_tokens = 0

    # ---- asynchronous steps: a step committed before its tokens are read back ----------
    def commit_ahead(self, plan: SchedulePlan) -> dict[str, int]:
        """Record a launched step whose sampled ids stay on the device: computed counts
        advance and each sampling chunk's sequence gets a PLACEHOLDER token, so that the
        next step is scheduled as if each continues. Returns {seq_id: index of its
        placeholder in output_token_ids}, for settle()."""
        at: dict[str, int] = {}
        for chunk in plan.chunks:
            seq = chunk.seq
            if seq.status is not SeqStatus.RUNNING:
                continue
            seq.num_computed_tokens = chunk.start + chunk.num_tokens
            self._cache_known_blocks(seq)
            if chunk.samples:
                seq.output_token_ids.append(PLACEHOLDER)
                seq.num_ahead += 1
                at[seq.seq_id] = len(seq.output_token_ids) - 1
        return at

    def settle(self, seq: Sequence, index: int, token: int | None) -> None:
        """Put a read-back token where commit_ahead left its placeholder; None (a row that
        failed) drops it and any placeholder after it."""
        if token is None:
            dropped = len(seq.output_token_ids) - index
            del seq.output_token_ids[index:]
            seq.num_ahead = max(0, seq.num_ahead - dropped)
            return
        seq.output_token_ids[index] = token
        seq.num_ahead -= 1
        if seq.status is SeqStatus.RUNNING:
            self._cache_known_blocks(seq)

    def _cache_known_blocks(self, seq: Sequence) -> None:
        """Register the full blocks computed so far whose token ids are all known."""
        if not self.kv.enable_prefix_caching:
            return
        bs = self.kv.block_size
        done = self.kv.num_cached_blocks(seq.seq_id)
        full = min(seq.num_computed_tokens, seq.num_tokens - seq.num_ahead) // bs
        if full > done:
            self.kv.cache_full_blocks(
                seq.seq_id, seq.token_ids(done * bs, full * bs), self.prefix_salt(seq)
            )
