"""Builds and loads the project's C++ CPU kernels (wattserve/kernels/csrc/) once per machine.

torch.utils.cpp_extension compiles the sources with the local C++ compiler (g++, and ninja
from PyPI) on first use, for this CPU's instruction set (-march=native), and keeps the
library in torch's extension cache (`$TORCH_EXTENSIONS_DIR`, default
~/.cache/torch_extensions); later processes load it in well under a second. The build's
name carries a hash of the sources and headers, the compiler flags, the torch version and
the CPU's flags, so a changed kernel or another processor gets its own build. Loading
registers the ops under `torch.ops.wattserve`. Where the build fails (no compiler),
`load_cpu_kernels()` returns False, says why once in the log, and callers take their
plain-torch paths; kernels_take(x) says whether they can take a tensor. It must not
decide which path a step takes (attention.py and norm_rope.py do).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = ("paged_attention.cpp", "fused_rows.cpp", "int_linear.cpp", "dense_linear.cpp")
# -fopenmp: at::parallel_for is OpenMP in torch's CPU build; without it the kernel runs
# on one thread whatever torch.get_num_threads() says.
_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=fast")
# WATTSERVE_CPU_KERNELS=0 turns the C++ kernels off (the plain-torch paths serve).
_ENV_SWITCH = "WATTSERVE_CPU_KERNELS"


def cpu_flags() -> str:
    """This CPU's `flags` line from /proc/cpuinfo (elsewhere the processor's name)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_name() -> str:
    """The extension's name: changes with the sources, flags, torch and the CPU's flags."""
    h = hashlib.sha256()
    for src in sorted(_CSRC.iterdir()):  # the sources and the headers they include
        h.update(src.name.encode())
        h.update(src.read_bytes())
    h.update(" ".join(_CFLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(cpu_flags().encode())
    return f"wattserve_cpu_kernels_{h.hexdigest()[:12]}"


# Process-wide by nature: loading registers ops in torch's own global registry, once.
@functools.cache
def load_cpu_kernels() -> bool:
    """Build (first time on this machine) and load the kernels; False when unavailable."""
    if os.environ.get(_ENV_SWITCH, "1") == "0":
        log.info("C++ CPU kernels off (%s=0): plain-torch attention", _ENV_SWITCH)
        return False
    from torch.utils import cpp_extension

    try:
        cpp_extension.load(
            name=build_name(),
            sources=[str(_CSRC / s) for s in _SOURCES],
            extra_cflags=list(_CFLAGS),
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:  # a missing compiler raises several types; all mean "not here"
        first = str(e).strip().splitlines()[:1]
        log.warning(
            "C++ CPU kernels unavailable, using plain-torch attention: %s: %s",
            type(e).__name__,
            first[0] if first else "",
        )
        return False
    _register_fake()
    return True


def kernels_take(x: torch.Tensor) -> bool:
    """Whether the C++ row kernels serve a call on x: a contiguous CPU tensor, and the
    kernels built here."""
    return x.device.type == "cpu" and x.is_contiguous() and load_cpu_kernels()


def _register_fake() -> None:
    """Shape-only implementations, so a traced or fake-tensor step sees the ops' outputs."""

    @torch.library.register_fake("wattserve::paged_attention")
    def _(q, k_cache, v_cache, block_tables, query_start, context_lens, scale, **_options):
        return torch.empty_like(q)

    @torch.library.register_fake("wattserve::rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x)

    @torch.library.register_fake("wattserve::add_rms_norm")
    def _(residual, addend, weight, eps):
        return torch.empty_like(residual)

    @torch.library.register_fake("wattserve::rope_write_kv")
    def _(qkv, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads):
        return qkv.new_empty(qkv.shape[0], num_heads, k_cache.shape[3])

    @torch.library.register_fake("wattserve::int_linear")
    def _(x, packed, scales, zeros, bits, group_size, out_features, bias):
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("wattserve::dense_linear")
    def _(x, packed, bias, out_features):
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("wattserve::silu_mul")
    def _(gate_up):
        return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
