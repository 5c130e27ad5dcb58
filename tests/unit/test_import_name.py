"""wattserve installs and imports under one name.

Every module of ours imports the project as `wattserve.<part>`: a bare `daemon`,
`controller`, `fleet`, `bench`, `sim` or `wattserve_kernels` import would pick up whatever
else owns that name (`python-daemon` installs `daemon`), or the repository's folder when run
from a checkout. The wheel test installs the built wheel beside python-daemon and imports
every module of both.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BARE = {"daemon", "controller", "fleet", "bench", "sim", "kernels", "wattserve_kernels"}
OUR_TREES = ("wattserve", "tests")


def _python_files() -> list[Path]:
    return sorted(p for tree in OUR_TREES for p in (ROOT / tree).rglob("*.py"))


def bare_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of each absolute import whose top-level name is a bare part name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [(node.lineno, n) for n in names if n.split(".")[0] in BARE]
    return found


def test_the_checker_sees_each_kind_of_bare_import():
    src = "import daemon\nfrom controller.policy import Policy\nimport bench.serve as s\n"
    src += "from wattserve.daemon import cli\nfrom . import sibling\nimport wattserve.fleet\n"
    assert [n for _, n in bare_imports(src)] == ["daemon", "controller.policy", "bench.serve"]


def test_no_module_of_ours_imports_a_bare_part_name():
    offenders = [
        f"{p.relative_to(ROOT)}:{line}: import of {name!r} (use wattserve.{name})"
        for p in _python_files()
        for line, name in bare_imports(p.read_text())
    ]
    assert offenders == []


def test_the_repository_holds_no_top_level_package_but_wattserve():
    # pytest puts the repository root on sys.path: a second top-level package there would
    # be importable under its bare name beside the installed one.
    packages = sorted(
        p.parent.name
        for p in ROOT.glob("*/__init__.py")
        if p.parent.name not in {"tests"}
    )
    assert packages == ["wattserve"]


def _has_python_daemon() -> bool:
    import importlib.metadata

    try:
        importlib.metadata.distribution("python-daemon")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _has_python_daemon(), reason="python-daemon (a test extra) is absent")
def test_the_wheel_installs_beside_python_daemon_and_every_module_of_both_imports(tmp_path):
    wheel_dir, target, src = tmp_path / "wheel", tmp_path / "site", tmp_path / "src"
    # Built from a copy: setuptools leaves build/ in the tree it builds, and a build/ left
    # from an older layout would put stale modules in the wheel.
    shutil.copytree(
        ROOT, src, ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "*.egg-info", "__pycache__", ".*_cache", "docs"
        ),
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "-q", "-w", str(wheel_dir), str(src)],
        check=True, capture_output=True, timeout=300,
    )
    (wheel,) = wheel_dir.glob("wattserve-*.whl")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
         str(wheel)],
        check=True, capture_output=True, timeout=300,
    )
    # From a folder outside the checkout, with the wheel's copy first on the path: every
    # module of ours and of python-daemon imports, each from where it was installed.
    script = textwrap.dedent(
        """
        import importlib, pkgutil, sys
        import daemon, wattserve
        assert wattserve.__file__.startswith(sys.argv[1]), wattserve.__file__
        assert "site-packages" in daemon.__file__ and not daemon.__file__.startswith(
            sys.argv[1]), daemon.__file__
        names = ["daemon"] + [m.name for m in pkgutil.walk_packages(daemon.__path__, "daemon.")]
        ours = [m.name for m in pkgutil.walk_packages(wattserve.__path__, "wattserve.")]
        for name in names + ours:
            importlib.import_module(name)
        assert sys.modules["daemon"].__file__ == daemon.__file__
        assert not any(n in sys.modules for n in ("controller", "fleet", "bench", "sim"))
        print(len(names), len(ours))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run(
        [sys.executable, "-c", script, str(target)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    n_daemon, n_ours = map(int, out.stdout.split())
    assert n_daemon >= 3 and n_ours >= 100
