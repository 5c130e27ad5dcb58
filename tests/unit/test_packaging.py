"""The installed environment: our top-level packages shadow no other distribution, and
a wheel carries every kernel source.

An editable install puts the repository's top-level packages on the import path; a
package of ours with the same import name as a dependency's hides that dependency (a
top-level `kernels` did so once transformers began to depend on the PyPI `kernels`)."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _our_top_level_packages() -> list[str]:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = cfg["tool"]["setuptools"]["packages"]["find"]["include"]
    names = [p.rstrip("*") for p in patterns]
    assert names and all((ROOT / n / "__init__.py").is_file() for n in names), names
    return names


def test_no_top_level_package_of_ours_is_another_distributions_import_name():
    owners = importlib.metadata.packages_distributions()
    for name in _our_top_level_packages():
        others = set(owners.get(name, [])) - {"wattserve"}
        assert not others, f"top-level package {name!r} is also shipped by {sorted(others)}"


def test_every_kernel_source_and_header_is_package_data():
    # A wheel (not the editable install) carries only what package-data names; a header
    # left out would break the kernels' build on the serving machine.
    import fnmatch

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = cfg["tool"]["setuptools"]["package-data"]["wattserve.kernels"]
    files = sorted(
        p.relative_to(ROOT / "wattserve/kernels").as_posix()
        for p in (ROOT / "wattserve/kernels" / "csrc").iterdir()
    )
    assert any(f.endswith(".h") for f in files) and any(f.endswith(".cpp") for f in files)
    assert [f for f in files if not any(fnmatch.fnmatch(f, pat) for pat in patterns)] == []
