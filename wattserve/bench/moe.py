"""`python -m wattserve.bench.moe`: a MoE layer's decode time against a dense one.

Random weights at one MoE model's layer shape (default Qwen3-30B-A3B's: hidden 2048, 128
experts, 8 active, expert intermediate 768), built straight into the engine's MoeBlock
(wattserve.daemon.engine.moe) for `--layers` layers, against the same number of dense
gate_up/silu/down MLPs with the same active parameters (intermediate = top-k x expert
intermediate). Only the feed-forward part is timed: attention, norms and the KV cache are
the same in both layers, so this is the stricter ratio. Each step runs `--tokens` fresh
random rows (a decode step of that many sequences) through every layer, so each step
routes to other experts, as decoding does; the median step over `--steps` is reported.
The last line printed is one JSON object. Nothing is downloaded; it must not be run as a
test (it holds ~2.4 GB of fp32 expert weights per layer at the default shape).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from wattserve.daemon.engine.moe import MoeBlock, MoeSpec, moe_block_from_weights
from wattserve.kernels.linear import Linear
from wattserve.kernels.norm_rope import silu_mul

TARGET_RATIO = 2.0  # issue 49: the MoE layer's decode time <= 2x the dense layer's


def moe_layers(
    spec: MoeSpec, hidden: int, layers: int, dtype: torch.dtype, std: float
) -> list[MoeBlock]:
    """`layers` random MoE blocks; each layer's stacked weights are dropped once packed."""

    def make(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        return Linear(weight.to(dtype).contiguous(), bias)

    out = []
    for _ in range(layers):
        inter, e = spec.intermediate_size, spec.num_experts
        router = torch.empty(e, hidden).normal_(0, std)
        gate_up = torch.empty(e, 2 * inter, hidden).normal_(0, std)
        down = torch.empty(e, hidden, inter).normal_(0, std)
        out.append(moe_block_from_weights(spec, router, gate_up, down, None, make, dtype))
        del router, gate_up, down
        gc.collect()
    return out


def dense_layers(
    hidden: int, inter: int, layers: int, dtype: torch.dtype, std: float
) -> list[tuple[Linear, Linear]]:
    return [
        (
            Linear(torch.empty(2 * inter, hidden).normal_(0, std).to(dtype)),
            Linear(torch.empty(hidden, inter).normal_(0, std).to(dtype)),
        )
        for _ in range(layers)
    ]


def time_steps(run, hidden: int, tokens: int, steps: int, warmup: int, dtype) -> list[float]:
    """Seconds of each of `steps` calls of run(x), x fresh [tokens, hidden] each time."""
    gen = torch.Generator().manual_seed(0)
    times = []
    for i in range(warmup + steps):
        x = torch.randn(tokens, hidden, generator=gen).to(dtype)
        t0 = time.perf_counter()
        run(x)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m wattserve.bench.moe", description=__doc__)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--moe-intermediate", type=int, default=768)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=1, help="rows per decode step")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args(argv)
    for name in ("hidden", "experts", "top_k", "moe_intermediate", "layers", "tokens", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.top_k > args.experts:
        ap.error("--top-k must not exceed --experts")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    std = args.hidden**-0.5  # unit-scale outputs: routing spread like a trained router's
    spec = MoeSpec(args.experts, args.top_k, args.moe_intermediate, True)
    active_inter = args.top_k * args.moe_intermediate
    dense = dense_layers(args.hidden, active_inter, args.layers, dtype, std)
    moe = moe_layers(spec, args.hidden, args.layers, dtype, std)

    def run_dense(x: torch.Tensor) -> None:
        for gate_up, down in dense:
            x = down(silu_mul(gate_up(x)))

    def run_moe(x: torch.Tensor) -> None:
        for block in moe:
            x = block(x)

    timing = dict(tokens=args.tokens, steps=args.steps, warmup=args.warmup, dtype=dtype)
    dense_s = time_steps(run_dense, args.hidden, **timing)
    moe_s = time_steps(run_moe, args.hidden, **timing)
    dense_ms = statistics.median(dense_s) * 1e3 / args.layers
    moe_ms = statistics.median(moe_s) * 1e3 / args.layers
    ratio = moe_ms / dense_ms
    print(f"dense MLP (intermediate {active_inter}): {dense_ms:.3f} ms/layer")
    print(f"MoE ({args.experts} experts, top {args.top_k}): {moe_ms:.3f} ms/layer")
    result = {
        "bench": "moe",
        "hidden": args.hidden,
        "experts": args.experts,
        "top_k": args.top_k,
        "moe_intermediate": args.moe_intermediate,
        "layers": args.layers,
        "tokens_per_step": args.tokens,
        "dtype": args.dtype,
        "threads": args.threads,
        "dense_ms_per_layer": round(dense_ms, 4),
        "moe_ms_per_layer": round(moe_ms, 4),
        "ratio_moe_vs_dense": round(ratio, 3),
        "target_ratio": TARGET_RATIO,
        "within_target": ratio <= TARGET_RATIO,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
