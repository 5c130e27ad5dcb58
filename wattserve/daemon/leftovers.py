"""Leftover temporary files: those whose writer, named by its pid, is certainly gone.

Writers here name their temporary files and directories with their own pid (the state
file's `.<name>.<pid>.tmp`, a model conversion's `<dir>.tmp<pid>`) and rename them into
place when done; a crash leaves them behind. At the next start they are removed, but
only when their writer cannot still be writing them:

- no process with that pid exists (it died);
- the pid exists but the entry is older than this boot (a pid reused since a reboot);
- the pid is this process's own and the entry is older than this process (a reused pid).

A live pid from this boot is never touched, whatever the entry's age: it may be another
wattserve (a second daemon, `bench quant`, `generate`) converting the same model right
now, and deleting its directory would break its rename. This module only removes what
matches a pattern in one directory, never follows a symlink, and never raises for it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
from pathlib import Path

import psutil

log = logging.getLogger(__name__)


def process_alive(pid: int) -> bool:
    """True when a process with this pid exists (also one owned by another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def writer_gone(pid: int, mtime_unix_s: float) -> bool:
    """Whether the process that wrote an entry (pid, last modified at mtime) is gone."""
    if pid <= 0 or not process_alive(pid):
        return True
    if mtime_unix_s < psutil.boot_time():
        return True
    if pid == os.getpid():
        return mtime_unix_s < psutil.Process().create_time()
    return False


def remove_leftovers(directory: Path, pattern: re.Pattern[str]) -> list[Path]:
    """Remove the entries of `directory` whose whole name matches `pattern` (group 1: the
    writer's pid) and whose writer is gone; returns what was removed. A missing directory
    holds nothing; a failure to remove one entry is logged and the others still go."""
    try:
        entries = sorted(directory.iterdir())
    except FileNotFoundError:
        return []
    except OSError as e:
        log.warning("cannot list %s for leftover temporary files: %s", directory, e.strerror)
        return []
    removed: list[Path] = []
    for path in entries:
        match = pattern.fullmatch(path.name)
        if match is None:
            continue
        try:
            st = path.lstat()
        except OSError:
            continue  # gone meanwhile
        pid = int(match.group(1))
        if not writer_gone(pid, st.st_mtime):
            continue
        try:
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(path)
            else:
                path.unlink()  # a file, or a link (removed itself, never followed)
        except OSError as e:
            log.warning("cannot remove leftover %s (writer pid %d gone): %s", path, pid, e)
            continue
        log.info("removed leftover %s (its writer, pid %d, is gone)", path, pid)
        removed.append(path)
    return removed
