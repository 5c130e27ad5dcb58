"""The engine on the virtual GPU: steps are booked and stretched; the clock-sweep trace."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from wattserve.bench import device_trace
from wattserve.daemon.config import DeviceConfig
from wattserve.daemon.coupling import device_step_hook, step_flops
from wattserve.daemon.device import open_device
from wattserve.daemon.engine.engine import Engine, EngineOptions
from wattserve.daemon.engine.request import SamplingParams


class RecordingDevice:
    def __init__(self, extra_s: float) -> None:
        self.extra_s = extra_s
        self.activities = []

    def record_engine_step(self, activity) -> float:
        self.activities.append(activity)
        return self.extra_s


def test_hook_books_every_step_and_waits_the_extra_time(tiny_llama):
    engine = Engine(tiny_llama, EngineOptions(kv_cache_bytes=1 << 20))
    device = RecordingDevice(extra_s=0.25)
    slept = []
    engine.add_step_hook(device_step_hook(engine, device, sleep=slept.append))
    out = engine.generate([[3, 4, 5, 6]], SamplingParams(max_tokens=5, temperature=0.0))[0]
    assert out.completion_tokens == 5
    assert len(device.activities) == engine.counters.steps == 5
    assert slept == [0.25] * 5
    prefill, decode = device.activities[0], device.activities[1]
    assert prefill.prefill_tokens == 4 and decode.decode_tokens == 1
    assert prefill.flops > decode.flops > 0
    assert decode.weight_bytes_read == engine.model.weight_bytes()


def test_flops_grow_with_tokens_and_context(tiny_llama):
    engine = Engine(tiny_llama, EngineOptions(kv_cache_bytes=1 << 20))
    shape = engine.model.shape
    per_token = engine.kv_spec.bytes_per_block // engine.kv_spec.block_size_tokens

    class Stats:
        def __init__(self, prefill, decode, ctx):
            self.prefill_tokens, self.decode_tokens = prefill, decode
            self.kv_bytes_read = ctx * per_token

    assert step_flops(shape, Stats(0, 8, 800), per_token) > step_flops(
        shape, Stats(0, 4, 800), per_token
    )
    assert step_flops(shape, Stats(0, 4, 1600), per_token) > step_flops(
        shape, Stats(0, 4, 800), per_token
    )


def test_lower_virtual_clock_slows_the_real_engine(tiny_llama, tmp_path):
    engine = Engine(tiny_llama, EngineOptions(kv_cache_bytes=1 << 20))
    device = open_device(DeviceConfig(backend="virtual", mode="control", state_dir=tmp_path))
    waits = []
    engine.add_step_hook(device_step_hook(engine, device, sleep=waits.append))
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0)
        engine.generate([[3] * 40], params)
        at_max = sum(waits)
        waits.clear()
        device.lock_sm_clocks_mhz(345, 345)
        engine.generate([[3] * 40], params)
        assert sum(waits) > at_max
    finally:
        device.close(restore=True)


def test_trace_writes_csv_png_and_json(tiny_dirs, tmp_path, capsys):
    rc = device_trace.main(
        [
            "--model",
            str(tiny_dirs["llama"]),
            "--seconds",
            "3",
            "--points",
            "3",
            "--batch",
            "4",
            "--prompt-tokens",
            "8",
            "--new-tokens",
            "8",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    rows = list(csv.DictReader((tmp_path / "device-trace.csv").open()))
    clocks = [int(r["sm_clock_mhz"]) for r in rows]
    assert len(clocks) == 3 and clocks[0] == 345 and clocks[-1] == 1980 and clocks == sorted(clocks)
    assert all(int(r["output_tokens"]) > 0 and float(r["energy_j"]) > 0 for r in rows)
    assert Path(tmp_path / "device-trace.png").stat().st_size > 10_000
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # The clock the line names has the least J/token; the CSV holds 4 decimals, so two
    # clocks can tie there while the line chose between them on the exact values.
    by_clock = {int(r["sm_clock_mhz"]): float(r["j_per_token"]) for r in rows}
    least = min(by_clock.values())
    assert by_clock[line["min_j_per_token_clock_mhz"]] == least
    assert line["j_per_token_min"] == least
    assert line["j_per_token_at_max_clock"] == round(float(rows[-1]["j_per_token"]), 4)
