"""The Triton row ops (rope with the KV write, the residual add with its norm, SiLU x up,
greedy ids) against their torch references, run by triton's interpreter on the CPU in one
subprocess (cases in triton_rows_cases.py). A tiny model's steps with these ops and the
Triton attention are test_triton_attention.py's."""

from __future__ import annotations

import pytest
import torch

from tests.unit.triton_interpret import interpreted_outputs
from tests.unit.triton_rows_cases import (
    DTYPES,
    ROPE,
    greedy_logits,
    norm_inputs,
    rope_inputs,
    silu_inputs,
)
from wattserve.kernels.attention import write_kv
from wattserve.kernels.norm_rope import (
    apply_rope_reference,
    rms_norm_reference,
    silu_mul_reference,
)

pytest.importorskip("triton", reason="triton is not installed (the test extras pin it)")

# The kernels round once, in float32; torch's bf16 ops round each product.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict:
    return interpreted_outputs(
        "tests.unit.triton_rows_cases", tmp_path_factory.mktemp("triton_rows")
    )


@pytest.mark.parametrize("dname", sorted(DTYPES))
@pytest.mark.parametrize("name", sorted(ROPE))
def test_rope_write_kv_matches_rope_then_index_copy(outputs, name, dname):
    dtype = DTYPES[dname]
    qkv, cos, sin, k_ref, v_ref, slots, heads, kv_heads = rope_inputs(name, dtype)
    t, d = qkv.shape[0], k_ref.shape[-1]
    rotated = apply_rope_reference(
        qkv.float().view(t, -1, d)[:, : heads + kv_heads], cos.float(), sin.float()
    )
    v = qkv.view(t, -1, d)[:, heads + kv_heads :]
    write_kv(k_ref, v_ref, slots, rotated[:, heads:].to(dtype), v)
    q, k_cache, v_cache = outputs[f"rope/{name}/{dname}"]
    assert q.shape == (t, heads, d) and q.is_contiguous()
    torch.testing.assert_close(q.float(), rotated[:, :heads], **TOL[dtype])
    torch.testing.assert_close(k_cache.float(), k_ref.float(), **TOL[dtype])
    assert torch.equal(v_cache, v_ref)  # copied, bit for bit
    untouched = torch.ones(k_ref.view(-1, kv_heads, d).shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache.view(-1, kv_heads, d)[untouched].any()


@pytest.mark.parametrize("dname", sorted(DTYPES))
def test_add_rms_norm_adds_in_place_and_normalizes(outputs, dname):
    dtype = DTYPES[dname]
    residual, addend, weight = norm_inputs(dtype)
    summed = residual + addend
    out, residual_after = outputs[f"add_rms_norm/{dname}"]
    if dtype == torch.float32:
        assert torch.equal(residual_after, summed)
    else:  # the interpreter's float32 -> bf16 store truncates; CUDA's rounds to nearest
        torch.testing.assert_close(residual_after, summed, atol=0, rtol=2**-7)
    torch.testing.assert_close(
        out.float(), rms_norm_reference(summed, weight, 1e-6).float(), **TOL[dtype]
    )


@pytest.mark.parametrize("dname", sorted(DTYPES))
def test_silu_mul_matches_reference(outputs, dname):
    dtype = DTYPES[dname]
    expected = silu_mul_reference(silu_inputs(dtype))
    torch.testing.assert_close(outputs[f"silu_mul/{dname}"].float(), expected.float(), **TOL[dtype])


def test_greedy_ids_first_maximum_and_failed_rows(outputs):
    x = greedy_logits()
    expected = x.argmax(dim=-1)
    expected[2:5] = -1  # NaN, +inf, nothing finite
    assert outputs["greedy"].tolist() == expected.tolist()
    assert outputs["greedy"][1] == 7  # a tie goes to the first index, as torch.argmax
