"""`wattserve bench control --engine model` end to end on a made-up calibration: the
engine model, the virtual GPU on a SimClock, the ControlLoop and the baselines, the
metrics, the plots and the JSON line. Simulated seconds; no model, no torch steps."""

from __future__ import annotations

import json

from bench import control
from daemon.cli import main as cli_main


def _calibration() -> control.Calibration:
    def level(scale: float, weight_bytes: int, ppl: float) -> control.LevelFit:
        return control.LevelFit(
            base_s=0.012 * scale,
            per_prefill_token_s=0.0015 * scale,
            per_decode_token_s=0.004 * scale,
            per_context_token_s=2e-6,
            noise_cv=0.1,
            weight_bytes=weight_bytes,
            prepare_s=1.0,
            samples=100,
            ppl_increase_pct=ppl,
        )

    return control.Calibration(
        model="made-up",
        dtype="float32",
        threads=2,
        full_precision="fp32",
        shape={
            "num_layers": 30,
            "hidden_size": 576,
            "num_heads": 9,
            "num_kv_heads": 3,
            "head_dim": 64,
            "intermediate_size": 1536,
            "vocab_size": 49152,
        },
        kv_bytes_per_token=46080,
        block_size_tokens=16,
        levels={"fp32": level(1.0, 538_000_000, 0.0), "bf16": level(0.6, 269_000_000, 0.1)},
        measured_at="test",
    )


def test_bench_control_model_engine_prints_the_headline_json(tmp_path, capsys):
    path = tmp_path / "cal.json"
    path.write_text(_calibration().to_json())
    rc = cli_main(
        [
            "bench",
            "control",
            "--calibration",
            str(path),
            "--levels",
            "fp32,bf16",
            "--scenarios",
            "steady60,budget_step",
            "--systems",
            "controller,max_clock,pid_power",
            "--duration-s",
            "45",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    line = json.loads(out[-1])
    for key in (
        "attainment_pct",
        "energy_saving_vs_max_clock_pct",
        "over_budget_pct",
        "settle_s",
        "overshoot_pct",
    ):
        assert key in line, key
    table = line["per_scenario"]
    assert set(table) == {"steady60", "budget_step"}
    for row in table["steady60"].values():
        assert row["requests"] > 0 and row["j_per_token"] > 0
    # The controller never draws more than the uncontrolled engine per token.
    assert (
        table["steady60"]["controller"]["j_per_token"]
        <= table["steady60"]["max_clock"]["j_per_token"]
    )
    assert (tmp_path / "control-model-steady60.png").stat().st_size > 10_000
    assert (tmp_path / "control-model-summary.png").is_file()
