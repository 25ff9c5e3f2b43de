"""Large tensors from a rank to the notebook through shared memory, not through the socket.

A rank writes each large CPU storage once into a file in /dev/shm (RAM); the notebook maps
the file (copy-on-write, so a later fork or an in-place change stays private, as ordinary
memory would) and unlinks it at once, so the pages live exactly as long as the tensor.
Pickled through the socket, a 500 MB tensor was copied four times and took ~3x its size in
the kernel. Where /dev/shm is too small (Docker gives 64 MB) the file goes to the temp
directory instead, whose pages the notebook maps the same way.

Every file of one launch starts with the launch's prefix (`NBTRAIN_RESULT_FILES`, set by the
launch for its ranks): `LaunchFiles.cleanup` removes whatever a rank wrote and the notebook
never mapped (a rank that died half-way, a result never unpacked), and a new launch removes
the files of kernels that died. Ranks on another machine cannot see this machine's files:
`NBTRAIN_SHARED_MEMORY=0` in a rank's environment makes it send bytes instead.
"""
from __future__ import annotations

import ctypes
import logging
import os
import re
import secrets
import tempfile
import threading

import torch

from .leftovers import remove_orphans

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX_VAR = "NBTRAIN_RESULT_FILES"  # the launch's file prefixes (os.pathsep between), for its ranks
ENABLE_VAR = "NBTRAIN_SHARED_MEMORY"  # "0": this rank sends tensors as bytes
INLINE_LIMIT = 1 << 20  # smaller storages travel inside the pickle: a file would cost more
_CHUNK = 1 << 26  # bytes per write() (Linux writes at most ~2 GiB at once) and per writer thread
_WRITERS = 4
_RESERVE = 64 << 20  # left free on the file system, for everyone else
_NAME = re.compile(r"nbtrain-(\d+)-[0-9a-f]{12}-r\d+-\d+")  # a rank's file, see RankFiles


class LaunchFiles:
    """The notebook's side: one launch's file prefixes, and the removal of its leftovers."""

    def __init__(self, roots: tuple[str, ...] | None = None):
        roots = roots if roots is not None else (SHM_DIR, tempfile.gettempdir())
        name = f"nbtrain-{os.getpid()}-{secrets.token_hex(6)}-"
        self.prefixes: list[str] = []
        for root in dict.fromkeys(roots):
            if os.path.isdir(root) and os.access(root, os.W_OK):
                remove_orphans(root, _NAME, _unlink)  # /dev/shm is memory: nobody else would
                self.prefixes.append(os.path.join(root, name))

    @property
    def environ(self) -> dict[str, str]:
        return {PREFIX_VAR: os.pathsep.join(self.prefixes)} if self.prefixes else {}

    def cleanup(self) -> None:
        """Remove what the ranks wrote and nobody mapped; mapped tensors keep their memory."""
        for prefix in self.prefixes:  # a plain prefix test: glob's pattern match per entry costs ms in a big /tmp
            root, start = os.path.split(prefix)
            try:
                entries = os.listdir(root)
            except OSError:
                continue
            for entry in entries:
                if entry.startswith(start):
                    _unlink(os.path.join(root, entry))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class RankFiles:
    """A rank's side: writes storages into files under the launch's prefixes."""

    def __init__(self, prefixes: list[str], rank: int):
        self.prefixes = [f"{prefix}r{rank}-" for prefix in prefixes]
        self.written: dict[int, str] = {}  # storage (its C pointer) -> file

    @classmethod
    def from_environ(cls, rank: int, environ=os.environ) -> RankFiles | None:
        prefixes = [p for p in environ.get(PREFIX_VAR, "").split(os.pathsep) if p]
        if not prefixes or environ.get(ENABLE_VAR, "1").strip().lower() in ("0", "false", "no", "off"):
            return None
        return cls(prefixes, rank)

    def write(self, storage: torch.UntypedStorage) -> str | None:
        """The file now holding `storage`'s bytes, or None where it should travel inline
        (small, not on the CPU, or no room for it)."""
        nbytes = storage.nbytes()
        if nbytes < INLINE_LIMIT or storage.device.type != "cpu":
            return None
        key = storage._cdata  # one file per storage, however many tensors view it
        if key not in self.written:
            data = memoryview((ctypes.c_char * nbytes).from_address(storage.data_ptr())).cast("B")
            for prefix in self.prefixes:
                path = f"{prefix}{len(self.written)}"
                if _room(prefix, nbytes) and _write_file(path, data):
                    self.written[key] = path
                    break
            else:
                return None
        return self.written[key]

    def discard(self) -> None:
        """Remove the files of a result that will not be sent."""
        for path in self.written.values():
            _unlink(path)
        self.written.clear()


def _room(prefix: str, nbytes: int) -> bool:
    try:
        stats = os.statvfs(os.path.dirname(prefix))
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize > nbytes + _RESERVE


def _write_file(path: str, data: memoryview) -> bool:
    """Write `data` to a new private file, on a few threads: most of the cost is the kernel
    finding fresh pages for it, which goes faster side by side. False if it did not fit."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        log.debug("no file for a returned tensor at %s: %s", path, exc)
        return False
    errors: list[OSError] = []

    def write(start: int, end: int) -> None:
        try:
            while start < end:
                start += os.pwrite(fd, data[start:min(end, start + _CHUNK)], start)
        except OSError as exc:  # ENOSPC: someone else filled the disk meanwhile
            errors.append(exc)

    nbytes = len(data)
    parts = max(1, min(_WRITERS, os.cpu_count() or 1, nbytes // _CHUNK))
    step = -(-nbytes // parts)
    threads = [threading.Thread(target=write, args=(i * step, min(nbytes, (i + 1) * step))) for i in range(1, parts)]
    for thread in threads:
        thread.start()
    write(0, min(nbytes, step))
    for thread in threads:
        thread.join()
    os.close(fd)
    if errors:
        log.debug("a returned tensor did not fit at %s: %s", path, errors[0])
        os.unlink(path)
        return False
    return True


def map_storage(path: str, nbytes: int) -> torch.UntypedStorage:
    """The notebook's side: the rank's file as a storage (private, copy-on-write), unlinked."""
    storage = torch.UntypedStorage.from_file(path, False, nbytes)
    os.unlink(path)  # the mapping keeps the pages; nothing is left to clean up
    return storage  # type: ignore[return-value]  # torch types from_file as its base class's
