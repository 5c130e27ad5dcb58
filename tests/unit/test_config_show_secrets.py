"""`wattserve config show` prints no secret: api_token and any *token / *password / *secret
field that is set shows as <redacted>; *_file fields (paths) show as they are."""

from __future__ import annotations

import tomllib

import pytest
from pydantic import BaseModel

from wattserve.daemon.cli import REDACTED, main, redact_secrets

SECRET = "s3cret-control-token"


pytestmark = pytest.mark.usefixtures("clean_wattserve_env")


def test_config_show_redacts_the_api_token(tmp_path, capsys, monkeypatch):
    config = tmp_path / "c.toml"
    config.write_text(
        f'[server]\napi_token = "{SECRET}"\napi_token_file = "{tmp_path / "token"}"\n'
        f'[mqtt]\nusername = "edge"\npassword_file = "{tmp_path / "mqtt-pw"}"\n'
    )
    assert main(["config", "show", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert SECRET not in out
    shown = tomllib.loads(out)
    assert shown["server"]["api_token"] == REDACTED
    assert shown["server"]["api_token_file"] == str(tmp_path / "token")
    assert shown["mqtt"]["password_file"] == str(tmp_path / "mqtt-pw")
    assert shown["mqtt"]["username"] == "edge"


def test_config_show_redacts_a_token_from_the_environment(capsys, monkeypatch):
    monkeypatch.setenv("WATTSERVE_SERVER__API_TOKEN", SECRET)
    assert main(["config", "show"]) == 0
    out = capsys.readouterr().out
    assert SECRET not in out and f'api_token = "{REDACTED}"' in out


def test_every_secret_named_field_is_redacted_and_nothing_else():
    class Broker(BaseModel):
        password: str | None = "pw"
        bridge_password: str | None = "pw2"
        refresh_token: str | None = "tok"
        client_secret: str | None = "sec"
        password_file: str | None = "/etc/pw"
        max_tokens: int = 16
        unset_token: str | None = None

    class Cfg(BaseModel):
        broker: Broker = Broker()

    shown = redact_secrets(Cfg()).broker  # type: ignore[arg-type]
    assert shown.password == shown.bridge_password == REDACTED
    assert shown.refresh_token == shown.client_secret == REDACTED
    assert shown.password_file == "/etc/pw" and shown.max_tokens == 16
    assert shown.unset_token is None  # unset stays visibly unset
