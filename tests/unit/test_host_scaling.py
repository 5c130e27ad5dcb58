"""How the engine's host work per step scales, counted deterministically (issue 48).

The engine runs on the CPU with its forward stubbed (wattserve.bench.host_time), so a
step is host work alone. Absolute times are `bench host`'s to report; held here is
their shape, by counts that do not depend on the machine or its load:

- a decode step touches the same number of elements of the sequences' token lists at a
  context of 2048 tokens as at 64 (token lists are a list subclass that counts what
  iteration, slicing and copying read), copies as many block ids into the step's block
  table (only those of new blocks), and the incremental detokenizer's memory per token
  does not grow with the text made so far;
- the Python and C calls a decode step makes grow linearly with the batch: the calls one
  more sequence adds are as many from 64 to 256 as from 1 to 64, and a sequence at batch
  256 costs no more calls than the single sequence at batch 1 (sys.setprofile counts).
"""

from __future__ import annotations

import sys
import tracemalloc
from dataclasses import dataclass

import pytest

from tests.tiny_model import build_tokenizer
from wattserve.bench import host_time
from wattserve.daemon.engine import engine as engine_module
from wattserve.daemon.engine.detokenizer import IncrementalDetokenizer
from wattserve.daemon.engine.request import SamplingParams
from wattserve.daemon.engine.scheduler import Sequence

STEPS = 32  # two 16-token blocks' worth of decode steps


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


class CountingList(list):
    """A token list that counts the elements read by iterating, slicing and copying it."""

    touched = 0  # over every instance (a class attribute, reset by the test)

    def __iter__(self):
        CountingList.touched += len(self)
        return super().__iter__()

    def __getitem__(self, i):
        if isinstance(i, slice):
            CountingList.touched += len(range(*i.indices(len(self))))
        return super().__getitem__(i)

    def __add__(self, other):
        CountingList.touched += len(self) + len(other)
        return super().__add__(other)

    def copy(self):
        CountingList.touched += len(self)
        return super().copy()

    def __contains__(self, x):
        CountingList.touched += len(self)
        return super().__contains__(x)

    def __reversed__(self):
        CountingList.touched += len(self)
        return super().__reversed__()

    def index(self, *a):
        CountingList.touched += len(self)
        return super().index(*a)

    def count(self, x):
        CountingList.touched += len(self)
        return super().count(x)


@dataclass(eq=False)
class CountingSequence(Sequence):
    def __post_init__(self) -> None:
        self.prompt_token_ids = CountingList(self.prompt_token_ids)
        self.output_token_ids = CountingList(self.output_token_ids)


def decoding_engine(tok, batch: int, context: int, vary_rows: bool = True):
    """An engine with `batch` sequences of `context` prompt tokens, all decoding."""
    stub = host_time.StubForward(batch, vary_rows=vary_rows)
    engine, _ = host_time.stub_engine(tok, batch, context + 4 * STEPS, stub)
    texts: dict[str, list[str]] = {}
    params = SamplingParams(max_tokens=3 * STEPS, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = [host_time.FIRST_ORDINARY_ID + (i + j) % 300 for j in range(context)]
        texts[f"r{i}"] = parts = []
        engine.add_request(prompt, params, lambda out, p=parts: p.append(out.text), f"r{i}")
    while engine.num_running < batch or any(
        s.num_tokens - s.num_computed_tokens > 1 for s in engine.scheduler.running
    ):
        engine.step()
    for _ in range(3):  # the first decode steps, overlap in flight
        engine.step()
    return engine, texts


def touched_per_step(tok, monkeypatch, context: int, batch: int = 4) -> float:
    monkeypatch.setattr(engine_module, "Sequence", CountingSequence)
    engine, texts = decoding_engine(tok, batch, context)
    CountingList.touched = 0
    for _ in range(STEPS):
        engine.step()
    touched = CountingList.touched
    assert engine.num_running == batch and all("".join(t) for t in texts.values())
    assert all(isinstance(s.output_token_ids, CountingList) for s in engine.scheduler.running)
    return touched / STEPS


def test_a_decode_step_reads_as_much_of_the_token_lists_at_2048_tokens_as_at_64(tok, monkeypatch):
    short = touched_per_step(tok, monkeypatch, 64)
    long = touched_per_step(tok, monkeypatch, 2048)
    assert long == short
    # the new token's row in the step's input and, once a block in 16 steps, its 16 ids
    # for the prefix cache: about 2 a sequence a step, never the whole history
    assert 0 < short <= 3 * 4


def block_ids_written_per_step(tok, context: int, batch: int = 4) -> float:
    engine, _ = decoding_engine(tok, batch, context)
    table = engine.model.host_block_table
    before = table.entries_written
    for _ in range(STEPS):
        engine.step()
    assert engine.num_running == batch
    return (table.entries_written - before) / STEPS


def test_a_decode_step_copies_only_new_block_ids_at_2048_tokens_as_at_64(tok):
    short = block_ids_written_per_step(tok, 64)
    long = block_ids_written_per_step(tok, 2048)
    assert long == short
    # a block id a sequence every 16 steps (two of them over the 32), not its whole table
    assert 0 < short <= 4 * 2 / STEPS


def test_the_detokenizer_keeps_no_history(tok):
    ids = tok.encode("abc def ghi jkl mno " * 4, add_special_tokens=False)

    def peak_bytes_of_one_token(history_tokens: int) -> int:
        detok = IncrementalDetokenizer(tok, [], ("zzq",))
        for i in range(history_tokens):
            detok.add(ids[i % len(ids)])
            detok.take()
        tracemalloc.start()
        try:
            detok.add(ids[0])
            detok.take()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    # ~10,000 characters of text before the token: a copy of it would show as ~10 KB
    assert peak_bytes_of_one_token(3000) <= peak_bytes_of_one_token(30) + 256


def calls_per_step(tok, batch: int) -> float:
    # Every row samples the same token, so each sequence's path through a step is the same.
    engine, texts = decoding_engine(tok, batch, 64, vary_rows=False)
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(count)
    try:
        for _ in range(STEPS):
            engine.step()
    finally:
        sys.setprofile(None)
    assert engine.num_running == batch and all("".join(t) for t in texts.values())
    return calls / STEPS


def test_per_sequence_host_work_is_the_same_at_batch_1_64_and_256(tok):
    one, mid, full = (calls_per_step(tok, b) for b in (1, 64, 256))
    per_seq_low = (mid - one) / 63
    per_seq_high = (full - mid) / 192
    # linear in the batch: no step work that grows with the batch squared
    assert per_seq_high <= 1.05 * per_seq_low, (one, mid, full)
    assert per_seq_high >= 0.95 * per_seq_low, (one, mid, full)
    # a sequence at batch 256 costs no more than the one sequence at batch 1
    assert full / 256 <= one, (one, full)


def test_the_host_time_bench_decodes_and_delivers_with_the_forward_stubbed(tok, monkeypatch):
    for name, value in (("WARMUP_STEPS", 2), ("WINDOW_STEPS", 3), ("WINDOWS", 2)):
        monkeypatch.setattr(host_time, name, value)
    monkeypatch.setattr(host_time, "PROMPT_TOKENS", 24)
    r = host_time.measure_batch(tok, 3)
    assert r.steps_timed == 6 and len(r.window_ms) == 2
    assert all(ms > 0 for ms in r.window_ms) and r.ms_per_step > 0
    # every timed step's token reached each request's consumer, text and all
    assert r.events_delivered >= 3 * 6 and r.text_chars >= 3 * 6
