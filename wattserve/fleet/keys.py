"""Read a fleet signing key from its file, refusing one that others may read.

A key file holds one secret line (e.g. `openssl rand -hex 32`); the key is its bytes
without surrounding whitespace. The file must be readable by its owner only (mode 0600
or 0400), else the start is refused with one line naming the file and the config key.
This module must not log the key or keep files open.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from wattserve.daemon.config import ConfigError
from wattserve.fleet.signing import MIN_KEY_BYTES, KeyRing


def read_key_file(path: Path, key_name: str) -> bytes:
    """The key in path; ConfigError naming key_name and path when it cannot be used."""
    p = Path(path).expanduser()
    try:
        with p.open("rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            data = f.read(4096)
    except OSError as e:
        raise ConfigError(f"config error: {key_name}: cannot read {p}: {e.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"config error: {key_name}: {p} has mode {stat.S_IMODE(mode):04o}; a key file "
            "must be readable by its owner only (chmod 600)"
        )
    key = data.strip()
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(
            f"config error: {key_name}: {p} holds {len(key)} bytes, fewer than {MIN_KEY_BYTES}"
        )
    return key


def read_key_ring(current: Path, previous: Path | None, key_name: str) -> KeyRing:
    """The current key and, during a rotation, the previous one."""
    return KeyRing(
        read_key_file(current, key_name),
        read_key_file(previous, key_name.replace("key_file", "previous_key_file"))
        if previous is not None
        else None,
    )
