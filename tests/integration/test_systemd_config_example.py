"""systemd/config.example.toml documents every key of wattserve/daemon/config.py with its default.

The example lists each key as a commented-out `# key = VALUE` line under its section;
a key whose default is None is written `# key = EXAMPLE  # default: unset`. Checked from
the pydantic models, so a key added to wattserve/daemon/config.py fails here until it is documented.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from wattserve.daemon.config import Config, load_config

EXAMPLE = Path(__file__).resolve().parents[2] / "systemd" / "config.example.toml"
_SECTION = re.compile(r"^\[([a-z_]+)\]\s*$")
_KEY_LINE = re.compile(r"^# ([a-z_][a-z0-9_]*) = (.+)$")
_UNSET = re.compile(r"#\s*default: unset\s*$")


pytestmark = pytest.mark.usefixtures("clean_wattserve_env")


def _example() -> dict[str, dict[str, tuple[Any, bool]]]:
    """section -> key -> (value shown, marked unset)."""
    out: dict[str, dict[str, tuple[Any, bool]]] = {}
    section = None
    for n, line in enumerate(EXAMPLE.read_text().splitlines(), 1):
        if m := _SECTION.match(line):
            section = m.group(1)
            out[section] = {}
        elif (m := _KEY_LINE.match(line)) and section is not None:
            key, rest = m.groups()
            try:
                value = tomllib.loads(f"{key} = {rest}")[key]
            except tomllib.TOMLDecodeError as e:
                raise AssertionError(f"{EXAMPLE.name}:{n}: not a TOML assignment: {e}") from None
            assert key not in out[section], f"{EXAMPLE.name}:{n}: {section}.{key} listed twice"
            out[section][key] = (value, bool(_UNSET.search(rest)))
    return out


def _defaults() -> dict[str, dict[str, Any]]:
    """section -> key -> default, as JSON-mode values (what TOML would hold)."""
    out = {}
    for section, field in Config.model_fields.items():
        model = field.annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        out[section] = model().model_dump(mode="json")
    return out


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


def test_every_config_key_is_documented_with_its_default() -> None:
    example, defaults = _example(), _defaults()
    assert list(example) == list(defaults), "sections differ from config.py's Config"
    missing = [
        f"[{s}] # {k} = {_toml(v)}" if v is not None else f"[{s}] # {k} = ...  # default: unset"
        for s, keys in defaults.items()
        for k, v in keys.items()
        if k not in example[s]
    ]
    assert not missing, "keys missing from systemd/config.example.toml:\n" + "\n".join(missing)
    unknown = [f"{s}.{k}" for s, keys in example.items() for k in keys if k not in defaults[s]]
    assert not unknown, f"keys in the example that config.py does not have: {unknown}"
    wrong = []
    for s, keys in defaults.items():
        for k, default in keys.items():
            shown, unset = example[s][k]
            if default is None and not unset:
                wrong.append(f"{s}.{k}: default is unset; mark the line '# default: unset'")
            elif default is not None and unset:
                wrong.append(f"{s}.{k}: marked unset, default is {_toml(default)}")
            elif default is not None and shown != default:
                wrong.append(f"{s}.{k}: shows {_toml(shown)}, default is {_toml(default)}")
    assert not wrong, "\n".join(wrong)


def test_example_loads_as_shipped_and_with_every_default_uncommented(tmp_path) -> None:
    assert load_config(EXAMPLE).model_dump() == load_config(None).model_dump()
    lines = []
    for line in EXAMPLE.read_text().splitlines():
        m = _KEY_LINE.match(line)
        lines.append(line[2:] if m and not _UNSET.search(m.group(2)) else line)
    uncommented = tmp_path / "config.toml"
    uncommented.write_text("\n".join(lines) + "\n")
    assert load_config(uncommented).model_dump() == load_config(None).model_dump()
    # The uncommented file really sets things: a changed value shows through.
    uncommented.write_text(uncommented.read_text().replace("port = 8000", "port = 8123"))
    assert load_config(uncommented).server.port == 8123
