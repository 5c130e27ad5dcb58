"""Our Triton paged attention against attention_reference, run on the CPU by triton's
interpreter (TRITON_INTERPRET=1) in one subprocess: decode, prefill after cached tokens and
mixed steps; 1, 3, 4, 8 and 16 query heads per KV head; head dims 64 and 128; fp32, bf16,
fp16; sliding windows and soft-caps (cases in triton_attention_cases.py); and a tiny
model's steps with the Triton backend and row ops (as on CUDA) against the same steps with
the C++ kernels."""

from __future__ import annotations

import pytest
import torch

from tests.unit.triton_attention_cases import CASES, build, model_steps
from tests.unit.triton_interpret import interpreted_outputs
from wattserve.kernels.attention import attention_reference

pytest.importorskip("triton", reason="triton is not installed (the test extras pin it)")

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-4),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict:
    return interpreted_outputs(
        "tests.unit.triton_attention_cases", tmp_path_factory.mktemp("triton")
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_attention_matches_reference(outputs, name):
    case = CASES[name]
    (q, k_cache, v_cache, *_), seqs = build(name)
    out = outputs[name]
    assert out.shape == q.shape and out.dtype == case.dtype
    opts = dict(sliding_window=case.sliding_window, logit_softcap=case.logit_softcap)
    for table, positions, row in seqs:
        rows = slice(row, row + len(positions))
        ref = attention_reference(q[rows], k_cache, v_cache, table, positions, case.scale, **opts)
        torch.testing.assert_close(out[rows].float(), ref, **TOL[case.dtype])


def test_model_steps_with_triton_attention_match_the_cpu_kernel(outputs):
    # The wiring: query tiles laid out with a mixed step's inputs, the decode-only variant
    # in eager and padded static decode steps, a chunked prompt.
    expected = model_steps("cpp")
    got = outputs["model"]
    assert sorted(got) == sorted(expected)
    for name, logits in expected.items():
        torch.testing.assert_close(got[name], logits, atol=1e-4, rtol=1e-4, msg=name)
