"""Padded static-layout steps against their eager originals, on the tiny model, on the CPU.

steps_padded_and_eager() runs a prompt chunk alone, mixed steps of 2, 3 and 4 chunks
(decodes with prompt chunks, some not sampled) and a decode-only step twice each: eagerly
from the step's own layout, and padded into a larger bucket's static buffer (more tokens,
wider tables) as a CUDA graph replays it, from the same cache state. test_step_buckets.py
compares them with the CPU kernels in process, and with the Triton kernels through
`python -m tests.unit.step_graph_cases OUT` under TRITON_INTERPRET=1 (the interpreter is
read when triton is imported: tests/unit/triton_interpret.py).
"""

from __future__ import annotations

import sys

import torch

from tests.tiny_model import tiny_hf_llama
from wattserve.daemon.engine.model import LlamaModel
from wattserve.daemon.engine.scheduler import ScheduledChunk, Sequence
from wattserve.daemon.engine.step_buckets import (
    Bucket,
    StaticStepInputs,
    next_power_of_two,
    step_kind,
)

BLOCK_SIZE = 4
TABLES = {
    "a": [5, 1, 20],
    "b": [3, 7, 0, 11],
    "c": [2, 9, 4, 15, 6],
    "d": [8, 10, 12, 13, 14, 16, 17],
}
PROMPT_TOKENS = {"a": 7, "b": 12, "c": 17, "d": 22}
# The steps compared under the Triton interpreter (slow): one chunk, four, a decode.
TRITON_STEPS = frozenset({"prefill_1_chunk", "mixed_4_chunks", "decode"})


def _plans() -> list[tuple[str, list[tuple[str, int, bool]]]]:
    """(name, [(sequence, tokens, samples)]) per step; each chunk starts where the
    sequence's computed tokens end."""
    return [
        ("prefill_1_chunk", [("a", 7, True)]),
        ("mixed_2_chunks", [("a", 1, True), ("b", 6, False)]),
        ("mixed_4_chunks", [("a", 1, True), ("b", 6, True), ("c", 9, False), ("d", 3, False)]),
        ("decode", [("a", 1, True), ("b", 1, True)]),
        ("mixed_3_chunks", [("b", 1, True), ("c", 8, True), ("d", 7, False)]),
    ]


def steps_padded_and_eager(
    backend: str, window: int | None = None, only: frozenset[str] | None = None
) -> dict[str, dict]:
    """Per step: eager and padded logits, and the real blocks of the KV pool after each.
    only: the steps to compare (None: all); the others just fill the cache, eagerly with
    the C++ kernels."""
    model = LlamaModel(tiny_hf_llama(weight_std=0.15), 24, BLOCK_SIZE, torch.float32, "cpu")
    if window is not None:
        model.sliding_windows = [window] * model.shape.num_layers
    seqs = {
        s: Sequence(s, [3 + (7 * i + k) % 80 for k in range(n)])
        for i, (s, n) in enumerate(PROMPT_TOKENS.items())
    }
    done = dict.fromkeys(seqs, 0)  # tokens in the cache
    out: dict[str, dict] = {}
    real = model.num_blocks  # the pad block is the last one
    for name, plan in _plans():
        chunks = [ScheduledChunk(seqs[s], done[s], n, sample) for s, n, sample in plan]
        compared = only is None or name in only
        model.attention_backend = backend if compared else "cpp"
        lay = model.layout(chunks, TABLES)
        if not compared:
            _commit(chunks, lay, model.forward(model.inputs_from(lay)), done)
            continue
        before = [t.clone() for t in model.k_cache + model.v_cache]
        eager = model.forward(model.inputs_from(lay))
        kv_eager = torch.stack([t[:real] for t in model.k_cache + model.v_cache])
        for t, saved in zip(model.k_cache + model.v_cache, before, strict=True):
            t.copy_(saved)
        kind = step_kind(lay)
        tokens = next_power_of_two(len(lay.input_ids) + 1)  # at least one padded token
        width = 2 * next_power_of_two(len(lay.block_tables[0]))
        rows = tokens if kind == "decode" else min(tokens - 1, 8)
        static = StaticStepInputs.allocate(model, Bucket(kind, tokens, width, rows))
        padded = model.forward(static.load(model, lay))
        kv_padded = torch.stack([t[:real] for t in model.k_cache + model.v_cache])
        out[name] = dict(
            eager=eager,
            padded=padded,
            rows=len(lay.logits_indices),
            kv_eager=kv_eager,
            kv_padded=kv_padded,
            bucket=(kind, tokens, width, rows),
        )
        _commit(chunks, lay, eager, done)
    return out


def _commit(chunks, lay, logits: torch.Tensor, done: dict[str, int]) -> None:
    for c in chunks:
        done[c.seq.seq_id] += c.num_tokens
        if c.samples:  # the next token, as sampled: any id will do
            c.seq.output_token_ids.append(int(logits[lay.sampled_chunks.index(c)].argmax()))


def main(out_path: str) -> None:
    import wattserve.kernels.triton_attention  # noqa: F401  (registers the op)
    from wattserve.kernels import norm_rope

    # The model's steps as on CUDA: the row ops on Triton kernels too.
    norm_rope.TRITON_ROW_DEVICES.add("cpu")
    # With a window only (the C++ runs cover both): the interpreter is slow.
    outputs = {"window": steps_padded_and_eager("triton", 5, TRITON_STEPS)}
    torch.save(outputs, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
