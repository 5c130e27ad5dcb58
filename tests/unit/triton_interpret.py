"""Run a Triton test-case module under triton's interpreter in a subprocess and load what it
saved: TRITON_INTERPRET=1 is read when triton's kernels are imported, so it cannot be set
in a test process that may have imported them already."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def interpreted_outputs(cases_module: str, out_dir: Path) -> dict:
    """`python -m cases_module OUT` with TRITON_INTERPRET=1; the dict it saved to OUT."""
    out = out_dir / "outputs.pt"
    env = dict(os.environ, TRITON_INTERPRET="1")
    subprocess.run(
        [sys.executable, "-m", cases_module, str(out)], cwd=ROOT, env=env, check=True, timeout=600
    )
    return torch.load(out)
