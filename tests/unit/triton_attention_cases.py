"""The Triton attention test cases: inputs built from a seed, and a runner for a subprocess.

test_triton_attention.py runs `python -m tests.unit.triton_attention_cases OUT` with
TRITON_INTERPRET=1 (which triton reads when the kernel module is imported, so it cannot be
set in a test process that may have imported it already); the runner saves every case's
kernel output to OUT, and the test compares each with attention_reference in its own
process. Contexts are a few dozen tokens: the interpreter runs programs in numpy.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass

import torch

from wattserve.kernels.attention import query_tiles

# (cached tokens before the queries, query tokens) per sequence
STEPS = {
    "decode": [(0, 1), (16, 1), (32, 1)],  # one token each: the decode-only variant
    "prefill": [(13, 20), (0, 18)],  # a chunk after cached tokens, a prompt from 0
    "mixed": [(9, 1), (20, 1), (7, 19), (0, 5)],
}


@dataclass(frozen=True)
class Case:
    step: str
    kv_heads: int
    group: int  # query heads per KV head
    head_dim: int
    dtype: torch.dtype
    block_size: int = 16
    scale: float = 0.25
    sliding_window: int | None = None
    logit_softcap: float | None = None


CASES = {
    "decode_g1_d64_fp32": Case("decode", 2, 1, 64, torch.float32),
    "decode_g4_d128_bf16": Case("decode", 2, 4, 128, torch.bfloat16),
    "decode_g8_d64_fp16": Case("decode", 1, 8, 64, torch.float16),
    "decode_g4_d64_window_softcap": Case(
        "decode", 2, 4, 64, torch.float32, sliding_window=6, logit_softcap=1.0
    ),
    "prefill_g1_d128_fp32": Case("prefill", 2, 1, 128, torch.float32),
    "prefill_g4_d64_bf16": Case("prefill", 2, 4, 64, torch.bfloat16),
    "prefill_g8_d128_fp32": Case("prefill", 1, 8, 128, torch.float32),
    "mixed_g4_d64_window": Case("mixed", 2, 4, 64, torch.float32, sliding_window=7),
    "mixed_g8_d64_softcap_bf16": Case(
        "mixed", 1, 8, 64, torch.bfloat16, scale=0.1, logit_softcap=1.5
    ),
    "mixed_g4_d128_window_softcap_fp16": Case(
        "mixed", 2, 4, 128, torch.float16, sliding_window=5, logit_softcap=2.0
    ),
    # a group that is not a power of two, blocks of 4 tokens (several blocks per key tile)
    "mixed_g3_d64_block4": Case("mixed", 3, 3, 64, torch.float32, block_size=4),
    # 16 heads per KV head: a query tile split over two programs
    "mixed_g16_d64": Case("mixed", 1, 16, 64, torch.float32),
}


def build(name: str):
    """A case's kernel arguments (q, k_cache, v_cache, block_tables, query_start,
    context_lens, query_tiles) and each sequence's (block table, query positions, first
    row of q)."""
    case = CASES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    heads = case.kv_heads * case.group
    pool = (48, case.block_size, case.kv_heads, case.head_dim)
    k_cache = torch.randn(pool, generator=g).to(case.dtype)
    v_cache = torch.randn(pool, generator=g).to(case.dtype)
    blocks = list(range(48))
    random.Random(name).shuffle(blocks)
    seqs, rows, used = [], 0, 0
    for cached, n in STEPS[case.step]:
        nb = -(-(cached + n) // case.block_size)
        seqs.append((blocks[used : used + nb], list(range(cached, cached + n)), rows))
        used, rows = used + nb, rows + n
    q = torch.randn(rows, heads, case.head_dim, generator=g).to(case.dtype)
    width = max(len(t) for t, _, _ in seqs)
    tables = torch.tensor([t + [blocks[-1]] * (width - len(t)) for t, _, _ in seqs])
    starts = [r for _, _, r in seqs] + [rows]
    lens = torch.tensor([pos[-1] + 1 for _, pos, _ in seqs])
    tiles = torch.tensor(query_tiles(starts), dtype=torch.long).view(-1, 2)
    return (q, k_cache, v_cache, tables, torch.tensor(starts), lens, tiles), seqs


def model_steps(backend: str) -> dict[str, torch.Tensor]:
    """Logits of a tiny model's steps with the given attention backend on the CPU: prompts
    (one chunked), a mixed step of decodes and a chunk after cached tokens, an eager decode
    and the same decode padded into a static bucket (batch 8) as a CUDA graph replays it."""
    from tests.tiny_model import tiny_hf_llama
    from wattserve.daemon.engine.model import LlamaModel
    from wattserve.daemon.engine.scheduler import ScheduledChunk, Sequence
    from wattserve.daemon.engine.step_buckets import Bucket, StaticStepInputs

    model = LlamaModel(tiny_hf_llama(weight_std=0.15), 24, 4, torch.float32, "cpu")
    model.attention_backend = backend
    seqs = [Sequence(s, list(range(2 + i, 9 + 6 * i))) for i, s in enumerate("abc")]
    tables = {"a": [5, 1, 20], "b": [3, 7, 0, 11], "c": [2, 9, 4, 15, 6]}
    a, b, c = seqs
    logits = {}
    logits["prompts"] = model.forward(  # a and b whole, c's first 6 tokens
        model.prepare(
            [ScheduledChunk(a, 0, 7, True), ScheduledChunk(b, 0, 12, True),
             ScheduledChunk(c, 0, 6, False)],
            tables,
        )
    )
    a.output_token_ids.append(11)
    b.output_token_ids.append(12)
    logits["mixed"] = model.forward(
        model.prepare(
            [ScheduledChunk(a, 7, 1, True), ScheduledChunk(b, 12, 1, True),
             ScheduledChunk(c, 6, 11, True)],
            tables,
        )
    )
    for s, tok in zip(seqs, (13, 14, 15), strict=True):
        s.output_token_ids.append(tok)
    decode = model.layout([ScheduledChunk(s, s.num_tokens - 1, 1, True) for s in seqs], tables)
    snapshot = [t.clone() for t in model.k_cache + model.v_cache]
    logits["decode"] = model.forward(model.inputs_from(decode))
    for t, saved in zip(model.k_cache + model.v_cache, snapshot, strict=True):
        t.copy_(saved)
    static = StaticStepInputs.allocate(model, Bucket("decode", 8, 8, 8))
    logits["decode_padded"] = model.forward(static.load(model, decode))[:3]
    return logits


def main(out_path: str) -> None:
    from wattserve.kernels import norm_rope
    from wattserve.kernels.triton_attention import triton_paged_attention

    # The model's steps as on CUDA: the row ops (rope with the KV write, the residual add
    # with its norm, SiLU x up, greedy ids: triton_rows.py) on Triton kernels too.
    norm_rope.TRITON_ROW_DEVICES.add("cpu")
    outputs = {"model": model_steps("triton")}
    norm_rope.TRITON_ROW_DEVICES.discard("cpu")
    for name, case in CASES.items():
        args, _ = build(name)
        outputs[name] = triton_paged_attention(
            *args,
            case.scale,
            sliding_window=case.sliding_window,
            logit_softcap=case.logit_softcap,
        )
    torch.save(outputs, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
