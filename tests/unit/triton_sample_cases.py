"""The device sampler's test cases (triton_sample.py, device_sampler.py): inputs built from
fixed seeds, and a runner for a subprocess under TRITON_INTERPRET=1, as triton_rows_cases.py.

`python -m tests.unit.triton_sample_cases OUT` saves each case's ids and logprobs to OUT;
test_triton_sample.py checks them in its own process. The interpreter runs one row in tens
of milliseconds, so the many-draw cases use a vocabulary of 10.
"""

from __future__ import annotations

import sys

import torch

# A small row whose token order is not its rank order; the kept sets below sit well clear
# of their rules' boundaries (no probability within 0.02 of a cut).
SMALL = torch.tensor([0.9, -1.5, 2.0, 0.2, 1.6, -0.8, 1.1, -2.5, 0.5, -0.3])
# name: (temperature, top_k, top_p, min_p, draws); each draw its own seed and step
# (min_p's draws, the cheapest, also give the frequencies: 3 runs of bisection passes cost
# the others about 3x as much a row)
DRAWS = {
    "top_k": (1.0, 3, 1.0, 0.0, 60),
    "top_p": (1.0, 0, 0.75, 0.0, 60),
    "mixed": (0.8, 6, 0.85, 0.05, 80),
    "min_p": (0.6, 0, 1.0, 0.1, 400),
}
VOCAB = 3000
# rows of the large batch: (temperature, top_k, top_p, min_p, seed, step), None: failing
BATCH = [
    (1.0, 0, 1.0, 0.0, 11, 0),
    "nan",
    (0.7, 40, 1.0, 0.0, 12, 5),
    "+inf",
    "-inf",
    (1.1, 0, 0.9, 0.0, 13, 2),
    (0.9, 100, 0.95, 0.1, 14, 1 << 40),
]


def draw_inputs(name: str):
    temperature, top_k, top_p, min_p, n = DRAWS[name]
    seeds = torch.arange(n, dtype=torch.long) * 7919 + len(name)
    steps = torch.arange(n, dtype=torch.long) % 5
    return (
        SMALL.expand(n, -1).contiguous(),
        torch.full((n,), temperature),
        torch.full((n,), top_k, dtype=torch.int32),
        torch.full((n,), top_p),
        torch.full((n,), min_p),
        seeds,
        steps,
    )


def large_logits(rows: int = len(BATCH)) -> torch.Tensor:
    """Random rows over VOCAB tokens (more than one block); the failing rows of BATCH hold
    a NaN, a +inf, or nothing finite; row 0 has a -inf among finite values."""
    g = torch.Generator().manual_seed(5)
    x = 3.0 * torch.randn(rows, VOCAB, generator=g)
    x[0, :700] = float("-inf")
    for r, row in enumerate(BATCH[:rows]):
        if row == "nan":
            x[r, 1234] = float("nan")
        elif row == "+inf":
            x[r, 17] = float("inf")
        elif row == "-inf":
            x[r] = float("-inf")
    return x


def batch_params():
    """BATCH's columns as tensors (failing rows sample at temperature 1)."""
    rows = [r if isinstance(r, tuple) else (1.0, 0, 1.0, 0.0, 0, 0) for r in BATCH]
    t, k, p, m, seed, step = zip(*rows, strict=True)
    return (
        torch.tensor(t),
        torch.tensor(k, dtype=torch.int32),
        torch.tensor(p),
        torch.tensor(m),
        torch.tensor(seed, dtype=torch.long),
        torch.tensor(step, dtype=torch.long),
    )


def greedy_logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, VOCAB, generator=g)
    x[1, 40] = x[1, 2900] = 20.0  # a tie: the first wins
    return x


def main(out_path: str) -> None:
    from wattserve.daemon.engine.device_sampler import device_ids
    from wattserve.daemon.engine.request import SamplingParams
    from wattserve.kernels import norm_rope, triton_sample  # noqa: F401  (registers the op)

    norm_rope.TRITON_ROW_DEVICES.add("cpu")
    op = torch.ops.wattserve
    outputs: dict[str, object] = {}
    for name in DRAWS:
        outputs[f"draws/{name}"] = op.triton_sample_ids(*draw_inputs(name))
    x = greedy_logits()
    n = x.shape[0]
    zeros = torch.zeros(n)
    outputs["greedy"] = op.triton_sample_ids(
        x, zeros, torch.zeros(n, dtype=torch.int32), zeros + 1, zeros, *[torch.arange(n)] * 2
    )
    outputs["batch"] = op.triton_sample_ids(large_logits(), *batch_params())
    # The sampled rows again, reordered among other rows, through device_ids.
    live = [r for r, row in enumerate(BATCH) if isinstance(row, tuple)]
    order = [live[2], live[0], live[3], live[1]]
    x = large_logits()
    other = 3.0 * torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(6))
    logits = torch.cat([other[:1], x[order], other[1:]])
    rows = [(0.5, 0, 1.0, 0.0, 99, 3), *[BATCH[r] for r in order], (1.0, 5, 1.0, 0.0, 98, 4)]
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=s)
        for t, k, p, m, s, _ in rows
    ]
    outputs["reordered"] = (device_ids(logits, params, [row[5] for row in rows]), order)
    torch.save(outputs, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
