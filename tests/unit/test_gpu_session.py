"""The lent-GPU session script, rehearsed on the CPU (scripts/gpu-session.sh --dry-run-cpu).

Each section writes its status and its JSON as it ends; the profiler section's summary is
checked on a CPU profile of the tiny model. The bench gpu section has its own dry-run test
(test_bench_gpu.py), so it is left out here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_session_writes_each_sections_json_as_it_ends(tmp_path):
    env = {
        **os.environ,
        "OUT": str(tmp_path),
        "PYTHON": sys.executable,
        "SECTIONS": "preflight profile",
    }
    proc = subprocess.run(
        [str(ROOT / "scripts" / "gpu-session.sh"), "--dry-run-cpu"],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr
    status = [json.loads(line) for line in (tmp_path / "sections.jsonl").read_text().splitlines()]
    assert [(s["section"], s["rc"]) for s in status] == [("preflight", 0), ("profile", 0)]
    pre = json.loads((tmp_path / "preflight.json").read_text())
    assert pre["torch"].startswith("2.") and pre["cuda"] is None
    prof = json.loads((tmp_path / "profile.json").read_text())
    assert prof["device"] == "cpu (dry run)"
    for batch in ("bs1", "bs64"):
        p = prof[batch]
        assert p["steps"] >= 1 and p["kernels_per_layer"] > 0 and p["top_kernels"]
        assert 0 < p["device_busy_fraction"] <= 1.0


def test_an_unknown_argument_is_refused_before_anything_runs(tmp_path):
    proc = subprocess.run(
        [str(ROOT / "scripts" / "gpu-session.sh"), "--fast"],
        env={**os.environ, "OUT": str(tmp_path)}, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2 and "usage" in proc.stderr
    assert not (tmp_path / "sections.jsonl").exists()
