"""Scheduler and KV cache driven by a fake runner: plain data, no model, no torch."""

from __future__ import annotations

import pytest

from wattserve.daemon.engine.kv_cache import KVCacheManager
from wattserve.daemon.engine.scheduler import EngineLimits, Scheduler, SeqStatus, Sequence


def fake_token(seq: Sequence) -> int:
    """Deterministic 'model': the next token depends only on the sequence's tokens so far."""
    return (sum(seq.token_ids(0, seq.num_tokens)) * 31 + seq.num_tokens) % 1000


def run_to_completion(sched: Scheduler, limits, max_new: dict[str, int], max_steps=10_000):
    """Drive schedule/commit like the engine does; returns outputs and per-step plans."""
    plans = []
    done: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not len(sched):
            break
        lim = limits(len(plans)) if callable(limits) else limits
        plan = sched.schedule(lim)
        plans.append(plan)
        sampled = {c.seq.seq_id: fake_token(c.seq) for c in plan.chunks if c.samples}
        sched.commit(plan, sampled)
        for c in plan.chunks:
            seq = c.seq
            if c.samples and len(seq.output_token_ids) >= max_new[seq.seq_id]:
                done[seq.seq_id] = list(seq.output_token_ids)
                sched.finish(seq.seq_id)
    assert not len(sched), "scheduler did not drain"
    return done, plans


def make(prompts: dict[str, int], num_blocks=64, bs=4, priorities=None):
    kv = KVCacheManager(num_blocks, bs)
    sched = Scheduler(kv)
    for i, (sid, n) in enumerate(prompts.items()):
        sched.add(Sequence(sid, [i + 1] * n, priority=(priorities or {}).get(sid, 0)))
    return kv, sched


def test_kv_allocation_is_all_or_nothing_and_never_leaks():
    kv = KVCacheManager(4, 16)
    assert kv.allocate("a", 40)  # 3 blocks
    assert not kv.allocate("b", 20)  # needs 2, 1 free: nothing taken
    assert kv.num_free_blocks == 1 and kv.table("b") == []
    assert kv.allocate("a", 48)  # still 3 blocks
    assert kv.allocate("a", 49) and kv.num_free_blocks == 0
    assert kv.free("a") == 4 and kv.num_free_blocks == 4
    assert kv.free("a") == 0


def test_token_budget_and_seq_cap_bound_each_step():
    kv, sched = make({f"s{i}": 10 for i in range(6)})
    limits = EngineLimits(max_num_seqs=3, max_num_batched_tokens=12)
    _, plans = run_to_completion(sched, limits, {f"s{i}": 5 for i in range(6)})
    assert max(p.num_tokens for p in plans) <= 12
    assert max(len(p.chunks) for p in plans) <= 3
    assert kv.num_free_blocks == kv.num_blocks


def test_long_prompt_is_chunked_and_decodes_keep_running():
    kv, sched = make({"short": 3})
    limits = EngineLimits(max_num_seqs=4, max_num_batched_tokens=8)
    first = sched.schedule(limits)  # admits "short": its 3 prompt tokens, then a sample
    sched.commit(first, {"short": 7})
    assert sched.get("short").output_token_ids == [7]
    sched.add(Sequence("long", [5] * 30))
    seen_long = 0
    for _ in range(5):
        plan = sched.schedule(limits)
        kinds = {c.seq.seq_id: c for c in plan.chunks}
        # The running decode is always served, first, with 1 token.
        assert plan.chunks[0].seq.seq_id == "short" and plan.chunks[0].num_tokens == 1
        assert kinds["long"].num_tokens <= 7
        seen_long += kinds["long"].num_tokens
        sched.commit(plan, {c.seq.seq_id: 1 for c in plan.chunks if c.samples})
    assert seen_long == 30
    assert sched.get("long").output_token_ids == [1]


def test_preemption_by_recompute_gives_identical_outputs():
    prompts = {f"s{i}": 5 + 3 * i for i in range(8)}
    max_new = {sid: 12 for sid in prompts}
    roomy, sched = make(prompts, num_blocks=200)
    expected, _ = run_to_completion(sched, EngineLimits(8, 64), max_new)
    tight, sched = make(prompts, num_blocks=12)  # 48 tokens for 8 sequences of up to 38
    got, plans = run_to_completion(sched, EngineLimits(8, 64), max_new)
    assert sum(len(p.preempted) for p in plans) > 0, "the tiny pool should force preemption"
    assert got == expected
    assert tight.num_free_blocks == tight.num_blocks


def test_lowering_the_cap_preempts_and_loses_nothing():
    prompts = {f"s{i}": 4 for i in range(10)}
    max_new = {sid: 20 for sid in prompts}
    _, sched = make(prompts)
    expected, _ = run_to_completion(sched, EngineLimits(10, 64), max_new)
    kv, sched = make(prompts)

    def limits(step):  # 10 seqs, then a cap of 2 from step 5, then 6 from step 30
        return EngineLimits(10 if step < 5 else 2 if step < 30 else 6, 64)

    got, plans = run_to_completion(sched, limits, max_new)
    assert got == expected
    assert all(len(p.chunks) <= 2 for p in plans[5:30])
    assert sum(len(p.preempted) for p in plans[5:6]) == 8
    assert kv.num_free_blocks == kv.num_blocks


def test_priority_orders_admission():
    _, sched = make({"late": 4, "urgent": 4, "normal": 4}, priorities={"urgent": -5})
    plan = sched.schedule(EngineLimits(max_num_seqs=1, max_num_batched_tokens=64))
    assert [c.seq.seq_id for c in plan.chunks] == ["urgent"]


def test_finish_frees_blocks_wherever_the_sequence_is():
    kv, sched = make({"a": 10, "b": 10})
    sched.schedule(EngineLimits(max_num_seqs=1, max_num_batched_tokens=64))
    assert sched.get("a").status is SeqStatus.RUNNING and kv.num_used_blocks == 3
    sched.finish("a")
    sched.finish("b")  # still waiting
    assert kv.num_free_blocks == kv.num_blocks and not sched.running and not sched.waiting
    assert sched.finish("a") is None


def test_limits_reject_nonsense():
    with pytest.raises(ValueError):
        EngineLimits(0, 10)
    with pytest.raises(ValueError):
        EngineLimits(1, 0)
