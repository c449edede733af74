"""Where sgl-tts keeps what it builds at set-up (converted models, the CPU shim library), and how it writes
files others read: atomically (`write_atomic`), and one process at a time in a folder (`folder_lock`)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import tempfile
from pathlib import Path
from typing import Iterator

from sgl_tts.env_names import cache_root

LOCK_FILE = ".lock"  # in a locked folder: the pid of the process holding it


def cache_dir() -> Path:
    """The cache root: $SGLTTS_CACHE, else ~/.cache/sgl-tts."""
    path = Path(cache_root())
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write `data` to `path` so that a reader (or a crash) sees the old file or the new one, never half of it:
    a temporary file in the same folder, flushed to disk, then `os.replace` onto `path`."""
    path = Path(path)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data.encode() if isinstance(data, str) else data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    return path


class FolderLocked(RuntimeError):
    """Another process holds the lock on a folder; the message names the folder and the holder's pid."""


@contextlib.contextmanager
def folder_lock(folder: str | Path, purpose: str, wait: bool = False, name: str = LOCK_FILE) -> Iterator[Path]:
    """Hold an exclusive lock (`fcntl.flock`) on `folder`'s lock file `name`, which names the holder's pid, while
    the block runs; the kernel releases it when the process ends, however it ends. Held elsewhere (another
    process, or another open of it in this one): raise FolderLocked (`wait=False`), or say so and wait for it
    (`wait=True`)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lock_path = folder / name
    with open(lock_path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "unknown"
            if not wait:
                raise FolderLocked(f"{folder} is in use by another process (pid {holder}, {lock_path}): "
                                   f"wait for it to finish before {purpose}") from None
            print(f"waiting for pid {holder} to release {folder} before {purpose}", file=sys.stderr, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        lock.seek(0)
        lock.truncate()
        lock.write(str(os.getpid()))
        lock.flush()
        try:
            yield lock_path
        finally:
            lock.seek(0)
            lock.truncate()
            lock.flush()
            fcntl.flock(lock, fcntl.LOCK_UN)
