"""Prefix caching in the KV cache and scheduler, driven by a fake runner: no model, no torch.

The fake runner keeps a 'KV' pool of its own: each computed token writes (position, token)
into the slot its block table names, and each sample reads the whole context back through
the table. A shared block overwritten, a block evicted while in use or a wrong table would
make that context differ from the sequence's tokens, which every sample asserts.
"""

from __future__ import annotations

import random

from wattserve.daemon.engine.kv_cache import KVCacheManager
from wattserve.daemon.engine.scheduler import EngineLimits, Scheduler, Sequence

BS = 4


class FakeKVRunner:
    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.slots: list[list[tuple[int, int] | None]] = [[None] * BS for _ in range(kv.num_blocks)]

    def run(self, plan) -> dict[str, int]:
        sampled = {}
        for c in plan.chunks:
            seq, table = c.seq, self.kv.table(c.seq.seq_id)
            end = c.start + c.num_tokens
            for p, tok in zip(range(c.start, end), seq.token_ids(c.start, end), strict=True):
                self.slots[table[p // BS]][p % BS] = (p, tok)
            if c.samples:
                ctx = [self.slots[table[p // BS]][p % BS] for p in range(end)]
                assert ctx == list(enumerate(seq.token_ids(0, end))), f"{seq.seq_id}: bad KV"
                sampled[seq.seq_id] = (sum(t * (p + 7) for p, t in ctx) * 31 + end) % 1000
        return sampled


def drive(sched: Scheduler, limits: EngineLimits, max_new: dict[str, int], abort_at=()):
    """Run like the engine: schedule, fake forward, commit, finish. At each step of
    abort_at, the last running sequence is aborted (its id lands in done as None)."""
    runner = FakeKVRunner(sched.kv)
    done: dict[str, list[int] | None] = {}
    plans = []
    for step in range(10_000):
        if not len(sched):
            break
        if step in abort_at and sched.running:
            done[sched.running[-1].seq_id] = None
            sched.finish(sched.running[-1].seq_id)
        plan = sched.schedule(limits)
        plans.append(plan)
        sched.commit(plan, runner.run(plan))
        for c in plan.chunks:
            seq = c.seq
            if c.samples and len(seq.output_token_ids) >= max_new[seq.seq_id]:
                done[seq.seq_id] = list(seq.output_token_ids)
                sched.finish(seq.seq_id)
    assert not len(sched), "scheduler did not drain"
    return done, plans


def shared_prefix_prompts(n: int, prefix_len: int, seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 1000) for _ in range(prefix_len)]
    prompts = {}
    for i in range(n):
        tail = [rng.randrange(1, 1000) for _ in range(rng.randint(0, 9))]
        prompts[f"s{i}"] = prefix[: prefix_len - (i % 3) * 5] + tail  # 3 prefix lengths
    prompts["dup"] = list(prompts["s0"])  # an exact repeat
    return prompts


def scheduler(prompts: dict[str, list[int]], num_blocks: int, caching: bool) -> Scheduler:
    sched = Scheduler(KVCacheManager(num_blocks, BS, enable_prefix_caching=caching))
    for sid, ids in prompts.items():
        sched.add(Sequence(sid, list(ids)))
    return sched


def test_blocks_are_shared_refcounted_kept_and_evicted_lru():
    kv = KVCacheManager(6, BS, enable_prefix_caching=True)
    a = list(range(1, 11))  # 10 tokens: 2 full blocks + 2
    assert kv.match(a).num_tokens == 0
    assert kv.allocate("a", 10)
    kv.cache_full_blocks("a", a[:8])
    # b shares a's 2 full blocks; a prompt equal to them leaves its last block to compute.
    hit = kv.match(a[:8] + [99])
    assert hit.num_tokens == 8 and hit.block_ids == tuple(kv.table("a")[:2])
    assert kv.match(a[:8]).num_tokens == 4
    assert kv.match([7] + a[1:]).num_tokens == 0  # a chain differs from its first block on
    assert kv.allocate("b", 9, hit)
    assert kv.table("b")[:2] == kv.table("a")[:2] and kv.num_used_blocks == 4
    assert kv.free("a") == 3  # the shared blocks stay with b; a's tail block goes back
    assert kv.num_used_blocks == 3 and kv.num_evictable_blocks == 0
    assert kv.free("b") == 3
    assert kv.num_free_blocks == 6 and kv.num_evictable_blocks == 2  # cached, unreferenced
    assert kv.match(a).num_tokens == 8  # still findable after both left
    assert kv.allocate("c", 16)  # takes the 4 empty blocks first: the cache survives
    assert kv.match(a).num_tokens == 8
    assert kv.allocate("d", 4)  # now one cached block is evicted: the chain's tail
    assert kv.match(a).num_tokens == 4
    assert not kv.allocate("e", 8, kv.match(a))  # 1 more block needed, none free: nothing taken
    assert kv.num_evictable_blocks == 1 and kv.table("e") == []
    kv.free("c")
    kv.free("d")
    assert kv.num_free_blocks == kv.num_blocks


def test_admission_charges_only_uncached_tokens():
    prompts = {"a": list(range(1, 14)), "b": list(range(1, 13)) + [50, 51, 52]}
    sched = scheduler({"a": prompts["a"]}, 32, caching=True)
    limits = EngineLimits(max_num_seqs=4, max_num_batched_tokens=64)
    runner = FakeKVRunner(sched.kv)
    plan = sched.schedule(limits)
    sched.commit(plan, runner.run(plan))
    assert (plan.prefix_queried_tokens, plan.prefix_hit_tokens) == (13, 0)
    sched.add(Sequence("b", prompts["b"]))
    plan = sched.schedule(limits)
    chunk = next(c for c in plan.chunks if c.seq.seq_id == "b")
    assert (chunk.start, chunk.num_tokens, chunk.samples) == (12, 3, True)
    assert (plan.prefix_queried_tokens, plan.prefix_hit_tokens) == (15, 12)
    assert plan.num_tokens == 1 + 3  # a's decode, b's 3 uncached tokens


def test_shared_prefix_outputs_identical_through_preemption_and_abort():
    prompts = shared_prefix_prompts(12, prefix_len=30)
    max_new = {sid: 9 for sid in prompts}
    limits = EngineLimits(max_num_seqs=6, max_num_batched_tokens=16)
    expected, _ = drive(scheduler(prompts, 400, caching=False), limits, max_new)
    for num_blocks, abort_at in ((400, ()), (24, ()), (24, (5, 12, 20))):
        sched = scheduler(prompts, num_blocks, caching=True)
        got, plans = drive(sched, limits, max_new, abort_at)
        aborted = {k for k, v in got.items() if v is None}
        assert len(aborted) == len(abort_at)
        assert got == {k: (None if k in aborted else v) for k, v in expected.items()}
        assert sum(p.prefix_hit_tokens for p in plans) > 0
        if num_blocks == 24:
            assert sum(len(p.preempted) for p in plans) > 0, "the tight pool should preempt"
        kv = sched.kv
        assert kv.num_used_blocks == 0 and kv.num_free_blocks == kv.num_blocks
        assert kv.num_evictable_blocks > 0  # what the last requests left cached


def test_caching_off_takes_nothing_from_the_cache():
    prompts = shared_prefix_prompts(4, prefix_len=30)
    sched = scheduler(prompts, 100, caching=False)
    _, plans = drive(sched, EngineLimits(4, 16), {s: 3 for s in prompts})
    assert sum(p.prefix_queried_tokens + p.prefix_hit_tokens for p in plans) == 0
    assert sched.kv.num_evictable_blocks == 0 and sched.kv.match(prompts["s0"]).num_tokens == 0


def test_equal_prompts_admitted_together_and_a_namespace_change():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    sched = Scheduler(kv)
    ids = list(range(1, 11))
    sched.add(Sequence("x", ids))
    sched.add(Sequence("y", ids))
    runner = FakeKVRunner(kv)
    plan = sched.schedule(EngineLimits(4, 64))  # both computed in full: nothing cached yet
    assert [c.start for c in plan.chunks] == [0, 0]
    sched.commit(plan, runner.run(plan))
    assert kv.table("x")[:2] != kv.table("y")[:2]  # y's equal blocks stay private
    assert kv.match(ids).block_ids == tuple(kv.table("x")[:2])
    sched.finish("x")
    sched.finish("y")
    assert kv.num_free_blocks == 16 and kv.num_evictable_blocks == 2
    kv.set_namespace("int8")
    assert kv.match(ids).num_tokens == 0
