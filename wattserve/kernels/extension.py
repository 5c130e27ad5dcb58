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
decide which path a step takes (attention.py and norm_rope.py do), and nothing on a CUDA
engine's path calls it (the GPU never waits for a CPU build).

A build holds our own `fcntl.flock` on `<build dir>/wattserve.lock`: the kernel releases it
when its holder dies, unlike torch's own lock file (`<build dir>/lock`, which records no
owner and stays behind when a build is killed mid-way, making every later load wait on
it). Under our lock no other build of ours runs there; a torch lock found then is stale
unless a live process still holds it open (torch keeps it open for its whole build: a
process that loads without our lock, such as an older wattserve), and a stale one is
removed (logged).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
from collections.abc import Iterator
from pathlib import Path

import psutil
import torch

log = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = ("paged_attention.cpp", "fused_rows.cpp", "int_linear.cpp", "dense_linear.cpp")
# -fopenmp: at::parallel_for is OpenMP in torch's CPU build; without it the kernel runs
# on one thread whatever torch.get_num_threads() says.
_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=fast")
# WATTSERVE_CPU_KERNELS=0 turns the C++ kernels off (the plain-torch paths serve).
_ENV_SWITCH = "WATTSERVE_CPU_KERNELS"
BUILD_PREFIX = "wattserve_cpu_kernels_"
# Ours (an flock, released by the kernel when its holder dies) and torch's (a file that
# cpp_extension.load creates exclusively and removes when done; a killed build leaves it).
BUILD_LOCK_NAME = "wattserve.lock"
_TORCH_LOCK_NAME = "lock"


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
    return f"{BUILD_PREFIX}{h.hexdigest()[:12]}"


def build_root() -> Path:
    """Where the builds live: torch's extension root ($TORCH_EXTENSIONS_DIR, else its
    per-Python, per-accelerator folder under ~/.cache/torch_extensions)."""
    from torch.utils import cpp_extension

    # torch's own resolution of the root (it also creates it), so that builds made by
    # earlier versions of this module, which let torch choose the folder, stay found.
    return Path(cpp_extension._get_build_directory("", verbose=False))


def load_cpu_kernels() -> bool:
    """Build (first time on this machine) and load the kernels; False when unavailable."""
    return _load_once()


# Process-wide by nature: loading registers ops in torch's own global registry, once.
@functools.cache
def _load_once() -> bool:
    if os.environ.get(_ENV_SWITCH, "1") == "0":
        log.info("C++ CPU kernels off (%s=0): plain-torch attention", _ENV_SWITCH)
        return False
    name = build_name()
    try:
        build_and_load(name, build_root() / name)
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


def build_and_load(name: str, build_dir: Path) -> None:
    """cpp_extension.load of the sources into build_dir, under our lock there."""
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    with build_lock(build_dir):
        torch_lock = build_dir / _TORCH_LOCK_NAME
        if torch_lock.exists() and not _held_open(torch_lock):
            log.warning(
                "C++ CPU kernels: removing the stale build lock %s (a build killed mid-way "
                "left it; no build of ours runs now)",
                torch_lock,
            )
            torch_lock.unlink(missing_ok=True)
        cpp_extension.load(
            name=name,
            sources=[str(_CSRC / s) for s in _SOURCES],
            extra_cflags=list(_CFLAGS),
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
        os.utime(build_dir)  # last used now: the cache pruner keeps recent builds longest


def _held_open(path: Path) -> bool:
    """Whether another live process has `path` open (as far as this user can see)."""
    target = str(path.resolve())
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if any(f.path == target for f in proc.open_files()):
                return True
        except (psutil.Error, OSError):
            continue  # gone meanwhile, or another user's: not one of our builds
    return False


@contextlib.contextmanager
def build_lock(build_dir: Path, *, wait: bool = True) -> Iterator[bool]:
    """Hold our flock on build_dir's lock file; yields False (not held) when `wait` is
    False and another process holds it."""
    with open(build_dir / BUILD_LOCK_NAME, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                yield False
                return
            log.info("C++ CPU kernels: another process is building in %s; waiting", build_dir)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


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

    @torch.library.register_fake("wattserve::greedy_rows")
    def _(logits):
        return logits.new_empty(logits.shape[0], dtype=torch.long)
