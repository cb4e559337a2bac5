"""shm's files in /dev/shm: the ones a killed process left behind, and removing this process's
stale ones before it opens its first shm endpoint. No native import."""

from __future__ import annotations

import contextlib
import os
import threading

_shm_cleared = {"pid": 0}
_shm_clear_lock = threading.Lock()


def _clear_stale_shm() -> None:
    """Before this process's first shm endpoint: remove /dev/shm files named after its pid.
    shm names an endpoint's region `<pid>:<ep>:<n>` and a SIGKILLed process leaves its region
    behind; once pids wrap (pid_max is 32,768 on many hosts) a new process with that pid
    failed to enable its endpoint (`fi_enable: Device or resource busy`). Any such file that
    exists before this process opened one belongs to a dead process."""
    with _shm_clear_lock:
        pid = os.getpid()  # per process: a forked child has not opened any yet
        if _shm_cleared["pid"] == pid:
            return
        _shm_cleared["pid"] = pid
        for path in shm_leftovers([pid]):
            with contextlib.suppress(OSError):
                os.unlink(path)


def shm_leftovers(pids: list[int] | None = None) -> list[str]:
    """Files in /dev/shm that libfabric's shm provider left behind.

    shm names its region `<pid>:<ep>:<n>` (the address `fi_shm://<pid>:...`). A clean close
    removes it; a SIGKILLed process leaves ~16 MiB. With `pids`, those processes' files; without,
    the files of processes that no longer exist.
    """
    root = "/dev/shm"
    try:
        names = os.listdir(root)
    except OSError:
        return []
    out = []
    for n in names:
        head = n.split(":", 1)[0]
        if ":" not in n or not head.isdigit():
            continue
        pid = int(head)
        if pids is not None:
            if pid in pids:
                out.append(os.path.join(root, n))
        elif not os.path.exists(f"/proc/{pid}"):
            out.append(os.path.join(root, n))
    return out
