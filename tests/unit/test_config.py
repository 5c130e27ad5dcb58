"""Configuration layering, validation errors and `wattserve config show`."""

from __future__ import annotations

import tomllib

import pytest
from pydantic import ValidationError

from wattserve.daemon.cli import main
from wattserve.daemon.config import ConfigError, load_config

pytestmark = pytest.mark.usefixtures("clean_wattserve_env")


def write(tmp_path, text):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_defaults_are_safe():
    cfg = load_config()
    assert cfg.server.host == "127.0.0.1" and cfg.server.port == 8000
    assert cfg.device.mode == "observe"
    assert cfg.server.api_token is None


def test_precedence_flag_over_env_over_file(tmp_path, monkeypatch):
    path = write(
        tmp_path, "[server]\nport = 8001\nhost = '127.0.0.2'\n[engine]\nmax_num_seqs = 8\n"
    )
    assert load_config(path).server.port == 8001
    monkeypatch.setenv("WATTSERVE_SERVER__PORT", "9000")
    cfg = load_config(path)
    assert cfg.server.port == 9000 and cfg.server.host == "127.0.0.2"
    cfg = load_config(path, {"server": {"port": 9100, "host": None}})
    assert cfg.server.port == 9100 and cfg.server.host == "127.0.0.2"
    assert cfg.engine.max_num_seqs == 8


@pytest.mark.parametrize(
    "text,needle",
    [
        ("[engine]\nbogus = 1\n", "engine.bogus: unknown key"),
        ("[nonsense]\nx = 1\n", "nonsense: unknown section"),
        ("[engine]\nmax_num_seqs = 0\n", "engine.max_num_seqs"),
        ("[server]\nport = 'eighty'\n", "server.port"),
        ("[engine]\ndtype = 'int3'\n", "engine.dtype"),
        ("[engine\n", "invalid TOML"),
    ],
)
def test_bad_file_fails_with_one_line_naming_the_key(tmp_path, text, needle):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_environment_is_named(monkeypatch):
    monkeypatch.setenv("WATTSERVE_ENGINE__MAX_NUM_SEQS", "-1")
    with pytest.raises(ConfigError, match="engine.max_num_seqs"):
        load_config()
    monkeypatch.delenv("WATTSERVE_ENGINE__MAX_NUM_SEQS")
    monkeypatch.setenv("WATTSERVE_ENGINE__NOPE", "1")
    with pytest.raises(ConfigError, match="engine.nope: unknown key"):
        load_config()
    monkeypatch.delenv("WATTSERVE_ENGINE__NOPE")
    monkeypatch.setenv("WATTSERVE_NOSUCHSECTION__X", "1")
    with pytest.raises(ConfigError, match="WATTSERVE_NOSUCHSECTION__X"):
        load_config()


def test_config_is_frozen():
    cfg = load_config()
    with pytest.raises(ValidationError, match="frozen"):
        cfg.server.port = 1  # type: ignore[misc]


def test_config_show_prints_effective_toml(tmp_path, capsys, monkeypatch):
    path = write(tmp_path, "[engine]\nmax_num_seqs = 12\n")
    monkeypatch.setenv("WATTSERVE_MQTT__PORT", "1999")
    assert main(["config", "show", "--config", str(path), "--port", "8123"]) == 0
    shown = tomllib.loads(capsys.readouterr().out)
    assert shown["engine"]["max_num_seqs"] == 12
    assert shown["server"]["port"] == 8123
    assert shown["mqtt"]["port"] == 1999


def test_config_show_bad_value_exits_2_with_one_line(capsys):
    assert main(["config", "show", "--port", "70000"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "server.port" in err
