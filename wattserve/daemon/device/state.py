"""The settings state file: the original GPU settings, written before the daemon changes them.

GPU settings outlive the process, so the first change to each knob records the value it
had before, atomically, in <state_dir>/device-<uuid>.json. A clean exit, the next start
after a crash, and `wattserve device reset` restore from it and then remove it. This
module only reads and writes that file (and removes its temporary copies that a dead
writer left); it never talks to a device.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from wattserve.daemon.device.protocol import DeviceIdentity, Knob, StateFileError
from wattserve.daemon.leftovers import process_alive, remove_leftovers

FORMAT_VERSION = 1


def resolve_state_dir(configured: Path | None, environ: Mapping[str, str] | None = None) -> Path:
    """device.state_dir if set; else systemd's $STATE_DIRECTORY; else the XDG state home."""
    env = os.environ if environ is None else environ
    if configured is not None:
        return Path(configured).expanduser()
    if env.get("STATE_DIRECTORY"):
        # systemd may pass several directories separated by ':'; ours is the first.
        return Path(env["STATE_DIRECTORY"].split(":")[0])
    base = env.get("XDG_STATE_HOME") or str(
        Path(env.get("HOME") or Path.home()) / ".local" / "state"
    )
    return Path(base) / "wattserve"


def state_file_path(state_dir: Path, identity: DeviceIdentity) -> Path:
    # UUIDs are stable across reboots and PCI renumbering; keep the name filesystem-safe.
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", identity.uuid)
    return state_dir / f"device-{safe}.json"


def boot_id() -> str | None:
    """This boot's id (Linux), to tell a live writer from one that died in an earlier boot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


@dataclass(frozen=True)
class SettingsRecord:
    """The content of a state file."""

    backend: str
    uuid: str
    pci_bus_id: str
    name: str
    pid: int
    boot_id: str | None
    recorded_at_unix_s: float
    originals: Mapping[Knob, Any] = field(default_factory=lambda: MappingProxyType({}))

    def written_by_live_other_process(self) -> bool:
        """True when another process that is still running (same boot) wrote this record."""
        if self.pid == os.getpid():
            return False
        current_boot = boot_id()
        if self.boot_id is not None and current_boot is not None and self.boot_id != current_boot:
            return False
        return process_alive(self.pid)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "backend": self.backend,
            "uuid": self.uuid,
            "pci_bus_id": self.pci_bus_id,
            "name": self.name,
            "pid": self.pid,
            "boot_id": self.boot_id,
            "recorded_at_unix_s": self.recorded_at_unix_s,
            "originals": {
                k.value: (list(v) if isinstance(v, tuple) else v) for k, v in self.originals.items()
            },
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], path: Path) -> SettingsRecord:
        try:
            if data.get("format") != FORMAT_VERSION:
                raise ValueError(f"unknown format {data.get('format')!r}")
            originals: dict[Knob, Any] = {}
            for key, value in data["originals"].items():
                knob = Knob(key)
                if knob is Knob.SM_CLOCKS and value is not None:
                    value = (int(value[0]), int(value[1]))
                elif knob is Knob.POWER_LIMIT:
                    value = float(value)
                originals[knob] = value
            return cls(
                backend=str(data["backend"]),
                uuid=str(data["uuid"]),
                pci_bus_id=str(data["pci_bus_id"]),
                name=str(data["name"]),
                pid=int(data["pid"]),
                boot_id=data.get("boot_id"),
                recorded_at_unix_s=float(data["recorded_at_unix_s"]),
                originals=MappingProxyType(originals),
            )
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise StateFileError(f"state file {path} is not valid: {e}") from None


class StateFile:
    """Reads and atomically rewrites one GPU's state file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _tmp_path(self) -> Path:
        return self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")

    def remove_leftover_temp_files(self) -> list[Path]:
        """Remove this file's temporary copies left by writers that died mid-write (the
        rules are wattserve.daemon.leftovers'); returns what was removed."""
        pattern = re.compile(rf"\.{re.escape(self.path.name)}\.(\d+)\.tmp")
        return remove_leftovers(self.path.parent, pattern)

    def load(self) -> SettingsRecord | None:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StateFileError(f"cannot read state file {self.path}: {e.strerror}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise StateFileError(f"state file {self.path} is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise StateFileError(f"state file {self.path} is not valid: not an object")
        return SettingsRecord.from_json(data, self.path)

    def record_original(self, identity: DeviceIdentity, knob: Knob, value: Any) -> bool:
        """Record knob's value before this daemon first changes it. True if newly recorded.

        A knob already in the file keeps its value: the oldest record is the true original,
        including one left by a crashed run that this process has taken over.
        """
        record = self.load()
        if record is not None and knob in record.originals:
            return False
        originals = dict(record.originals) if record is not None else {}
        originals[knob] = value
        self._write(
            SettingsRecord(
                backend=identity.backend,
                uuid=identity.uuid,
                pci_bus_id=identity.pci_bus_id,
                name=identity.name,
                pid=os.getpid(),
                boot_id=boot_id(),
                recorded_at_unix_s=record.recorded_at_unix_s if record else time.time(),
                originals=MappingProxyType(originals),
            )
        )
        return True

    def forget(self, knob: Knob) -> None:
        """Drop one knob (restored, or never changed); removes the file when it becomes empty."""
        record = self.load()
        if record is None or knob not in record.originals:
            return
        originals = {k: v for k, v in record.originals.items() if k != knob}
        if not originals:
            self.clear()
            return
        self._write(dataclasses.replace(record, originals=MappingProxyType(originals)))

    def clear(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            return
        except OSError as e:
            raise StateFileError(f"cannot remove state file {self.path}: {e.strerror}") from None
        self._fsync_dir()

    def _write(self, record: SettingsRecord) -> None:
        # Write-then-rename so a crash mid-write leaves the previous record, never half a file.
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = self._tmp_path()
            with open(tmp, "w") as f:
                json.dump(record.to_json(), f, indent=2, sort_keys=True)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as e:
            raise StateFileError(f"cannot write state file {self.path}: {e.strerror}") from None
        self._fsync_dir()

    def _fsync_dir(self) -> None:
        try:
            fd = os.open(self.path.parent, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)
