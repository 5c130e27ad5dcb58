"""The daemon gives its controller bench quant's table for the model it serves, read from
the cache directory: the perplexity figures let `max_ppl_increase_pct` allow a quantized
level, and the speeds order the controller's trials. /v1/status shows what it got. A
table measured against another full-precision level, or none, leaves the levels without
measured quality: under a quality limit, full precision only."""

from __future__ import annotations

import httpx
import pytest

from tests.api_server import api_config, running_server
from wattserve.daemon.quant_table import (
    QUALITY_TABLE_VERSION,
    quality_table_path,
    save_quality_table,
)


def _table(full_precision: str) -> dict:
    return {
        "version": QUALITY_TABLE_VERSION,
        "full_precision": full_precision,
        "levels": {
            "fp32": {"ppl_increase_pct": 0.0, "decode_tok_s_bs16": 300.0, "prefill_tok_s": 900.0},
            "int8": {"ppl_increase_pct": 0.5, "decode_tok_s_bs16": 450.0, "prefill_tok_s": 150.0},
        },
    }


@pytest.mark.parametrize("table_full_precision", ["fp32", "bf16", None])
def test_the_daemon_reads_the_quality_table_of_the_model_it_serves(
    tiny_llama, tmp_path, table_full_precision
):
    if table_full_precision is not None:
        path = quality_table_path(tmp_path, tiny_llama.name)
        save_quality_table(path, _table(table_full_precision))
    cfg = api_config(
        engine={"cache_dir": str(tmp_path), "quantization_levels": ["fp32", "int8"]},
        device={"backend": "virtual", "mode": "control", "state_dir": str(tmp_path)},
        controller={"mode": "observe", "max_ppl_increase_pct": 2.0},
    )
    with running_server(cfg, tiny_llama) as server:
        status = httpx.get(f"{server.base_url}/v1/status", timeout=10).json()
    levels = status["controller"]["quant_levels"]
    assert set(levels) == {"fp32", "int8"}
    assert levels["fp32"]["allowed"]
    if table_full_precision == "fp32":
        assert levels["int8"] == {
            "allowed": True,
            "ppl_increase_pct": 0.5,
            "decode_tok_s": 450.0,
            "prefill_tok_s": 150.0,
        }
    else:  # no table, or one measured against bf16 weights: nothing measured for this model
        assert levels["int8"] == {
            "allowed": False,
            "ppl_increase_pct": None,
            "decode_tok_s": None,
            "prefill_tok_s": None,
        }
