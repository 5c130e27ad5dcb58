"""The device sampler (triton_sample.py's kernel through its op and device_sampler.py), run
by triton's interpreter on the CPU in one subprocess (cases in triton_sample_cases.py):
greedy rows take the first argmax, no draw leaves the kept set of top-k, top-p or min-p,
the draws' frequencies follow the renormalised kept distribution, a row's token depends on
its seed and step only, and failing rows give -1 beside rows that still sample."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from tests.unit.triton_interpret import interpreted_outputs
from tests.unit.triton_sample_cases import (
    BATCH,
    DRAWS,
    SMALL,
    batch_params,
    greedy_logits,
    large_logits,
)
from wattserve.daemon.engine.device_sampler import device_ids
from wattserve.daemon.engine.request import SamplingParams

pytest.importorskip("triton", reason="triton is not installed (the test extras pin it)")


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict:
    return interpreted_outputs(
        "tests.unit.triton_sample_cases", tmp_path_factory.mktemp("triton_sample")
    )


def kept_distribution(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> torch.Tensor:
    """sampler.py's rules in float64 with a sort: top-k first, then top-p and min-p over the
    probabilities renormalised over the top k; the kept tokens' renormalised probabilities."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = torch.argsort(probs, descending=True)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if 0 < top_k < len(probs):
        keep[order[top_k:]] = False
    probs = torch.where(keep, probs, 0.0)
    probs /= probs.sum()
    sorted_probs = probs[order]
    above = torch.zeros_like(probs)
    above[order] = sorted_probs.cumsum(0) - sorted_probs
    keep &= above < top_p
    keep &= probs >= min_p * probs.max()
    kept = torch.where(keep, probs, 0.0)
    return kept / kept.sum()


@pytest.mark.parametrize("name", sorted(DRAWS))
def test_draws_stay_in_the_kept_set(outputs, name):
    temperature, top_k, top_p, min_p, n = DRAWS[name]
    ids, logprob = outputs[f"draws/{name}"]
    expected = kept_distribution(SMALL, temperature, top_k, top_p, min_p)
    kept = expected > 0
    assert 1 < int(kept.sum()) < len(SMALL)  # the rule cuts, and leaves a choice
    assert ids.shape == (n,) and ids.dtype == torch.long
    assert kept[ids].all(), f"drawn outside the kept set: {sorted(set(ids[~kept[ids]].tolist()))}"
    assert set(ids.tolist()) == set(kept.nonzero().flatten().tolist())  # every kept one drawn
    torch.testing.assert_close(logprob, torch.log_softmax(SMALL, -1)[ids])


def test_min_p_draws_match_the_kept_distribution(outputs):
    temperature, top_k, top_p, min_p, n = DRAWS["min_p"]
    ids, _ = outputs["draws/min_p"]
    expected = kept_distribution(SMALL, temperature, top_k, top_p, min_p)
    seen = torch.bincount(ids, minlength=len(SMALL)).double() / n
    tv = 0.5 * (seen - expected).abs().sum().item()
    # 400 fixed draws: expected sampling noise ~0.03; at temperature 1 instead of 0.6 the
    # same kept tokens would be 0.11 away
    assert tv < 0.05, (tv, seen.tolist(), expected.tolist())


def test_greedy_rows_take_the_first_argmax(outputs):
    x = greedy_logits()
    ids, logprob = outputs["greedy"]
    assert ids.tolist() == x.argmax(dim=-1).tolist()
    assert ids[1] == 40  # tied with 2900
    torch.testing.assert_close(logprob, torch.log_softmax(x, -1).gather(1, ids[:, None])[:, 0])


def test_failing_rows_give_minus_one_and_the_others_sample(outputs):
    ids, logprob = outputs["batch"]
    failing = [not isinstance(row, tuple) for row in BATCH]
    assert [t == -1 for t in ids.tolist()] == failing
    assert logprob[torch.tensor(failing)].isnan().all()
    x = large_logits()
    live = torch.tensor([not f for f in failing])
    t, k, p, m, _, _ = batch_params()
    for r in live.nonzero().flatten().tolist():
        assert torch.isfinite(x[r, ids[r]])
        kept = kept_distribution(x[r], float(t[r]), int(k[r]), float(p[r]), float(m[r])) > 0
        assert kept[ids[r]]
    torch.testing.assert_close(
        logprob[live], torch.log_softmax(x[live], -1).gather(1, ids[live][:, None])[:, 0]
    )


def test_a_rows_token_depends_on_its_seed_and_step_not_its_batch(outputs):
    """The sampled rows of the batch, reordered between other rows and sent through
    device_ids (one upload of SamplingParams and steps), draw the same tokens."""
    batch_ids, _ = outputs["batch"]
    reordered, order = outputs["reordered"]
    assert reordered.shape == (len(order) + 2,)
    assert reordered[1:-1].tolist() == batch_ids[order].tolist()


def test_device_ids_is_none_where_triton_does_not_run():
    params = [SamplingParams(temperature=0.7, seed=1)]
    assert device_ids(torch.zeros(1, 8), params, [0]) is None


class _Ops(TorchDispatchMode):
    """The ops dispatched, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


_VIEWS = {"aten.view.dtype", "aten.view.default", "aten.slice.Tensor", "aten.select.int"}
_VIEWS |= {"aten.detach.default", "prim.device.default", "aten.lift_fresh.default"}


@pytest.mark.parametrize("steps_on_device", [False, True])
def test_device_ids_uploads_once_and_launches_once_on_a_fake_cuda(steps_on_device):
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_p=0.9, seed=3),
        SamplingParams(top_k=5, min_p=0.1, seed=2**64 + 3),  # seeds wrap to 64 bits
    ]
    with FakeTensorMode():
        logits = torch.empty(3, 500, device="cuda")
        steps = torch.zeros(3, dtype=torch.long, device="cuda") if steps_on_device else [0, 4, 9]
        with _Ops() as ops:
            ids = device_ids(logits, params, steps)
    assert ids is not None and ids.shape == (3,) and ids.dtype == torch.long
    assert ids.device.type == "cuda"
    work = [name for name in ops.names if name not in _VIEWS]
    # the host packs the parameters (one cat), one copy uploads them, one launch samples
    assert work == [
        "aten.cat.default",
        "aten._to_copy.default",
        "wattserve.triton_sample_ids.default",
    ]


def test_the_kernel_compiles_for_sm90():
    """Compiled ahead of time for the H100/H200 (sm_90) with triton's bundled ptxas: the
    interpreter runs the numerics but not the compiler's type rules (the search loops'
    carried values keep their types)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from wattserve.kernels.triton_sample import _sample_kernel, kernel_config

    constexprs, num_warps = kernel_config(151_936)
    signature = {"logits": "*fp32", "temperature": "*fp32", "top_k": "*i32"}
    signature |= {"top_p": "*fp32", "min_p": "*fp32", "seed": "*i64", "step": "*i64"}
    signature |= {"ids_out": "*i64", "logprob_out": "*fp32", "stride": "i32", "vocab": "i32"}
    signature |= {name: "constexpr" for name in constexprs}
    compiled = triton.compile(
        ASTSource(_sample_kernel, signature, constexprs),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=num_warps),
    )
    assert compiled.asm["cubin"]  # through ptxas to a binary
    assert compiled.metadata.shared <= 227 * 1024  # fits an H100/H200 SM's shared memory
