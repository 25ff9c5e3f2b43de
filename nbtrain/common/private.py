"""Files nbtrain writes, and reads back, on a machine shared with other people.

Written: whole or not at all (a temporary name beside the target, every byte checked, fsync,
rename), 0600 in a 0700 directory whatever the umask. Read back: only from a file this user
owns, reached through no symbolic link, since a pickle read from someone else's file runs their
code as you. Every file of a run directory, a job directory and a tracked launch's directory
goes through here.
"""
from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

from .errors import NbtrainError

FILE_MODE = 0o600
DIR_MODE = 0o700


class IncompleteWrite(NbtrainError, OSError):
    """A file could not be written whole; the target was left as it was."""

    def __init__(self, path: Path, error: OSError, wrote: int, size: int):
        reason = (error.strerror or str(error)).lower()
        super().__init__(error.errno, f"{path.name}: {reason} (wrote {wrote:,} of {size:,} bytes)")
        self.path, self.wrote, self.size = path, wrote, size

    def __reduce__(self):  # crosses processes: rebuilt from its parts
        return _rebuild, (self.path, self.errno, self.strerror, self.wrote, self.size)

    def __str__(self) -> str:
        return str(self.strerror)  # always set: __init__ gives it


def _rebuild(path, code, text, wrote, size):
    error = IncompleteWrite.__new__(IncompleteWrite)
    OSError.__init__(error, code, text)
    error.path, error.wrote, error.size = path, wrote, size
    return error


class NotYours(NbtrainError, PermissionError):
    """A path that is not this user's own, or is reached through a symbolic link."""


def check_own(path: Path, what: str = "") -> os.stat_result:
    """lstat `path`: refuse a symbolic link and anything another user owns (NotYours)."""
    info = os.lstat(path)
    name = f"{what} {str(path)!r}" if what else repr(str(path))
    if stat.S_ISLNK(info.st_mode):
        raise NotYours(errno.EPERM, f"{name} is a symbolic link; nbtrain reads and writes run files only in "
                                    "directories it made, never through a link: give the real path")
    if info.st_uid != os.geteuid():
        raise NotYours(errno.EPERM, f"{name} belongs to {_user(info.st_uid)}, not to you; nbtrain reads "
                                    "back only its own files (one made by another user could run code as you)")
    return info


def _user(uid: int) -> str:
    try:
        import pwd

        return f"user {pwd.getpwuid(uid).pw_name!r} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def make_parents(path: Path) -> None:
    """The missing parents of `path`, made 0700 whatever the umask (under umask 000, a folder
    made with the usual mode would let another account replace what is saved in it); those that
    exist are left as they are."""
    missing, parent = [], Path(path).parent
    while not os.path.lexists(parent) and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, DIR_MODE)
        except FileExistsError:  # made meanwhile: whoever uses it checks it
            continue
        os.chmod(folder, DIR_MODE)  # mkdir's mode passes through the umask


def private_dir(path: Path, *, exist_ok: bool = True) -> Path:
    """`path` as a directory only this user can enter: made 0700 (its missing parents too), or,
    if it exists, checked as ours and no link, then set to 0700."""
    path = Path(path)
    make_parents(path)
    try:
        path.mkdir(mode=DIR_MODE)
    except FileExistsError:
        if not exist_ok:
            raise
        if not stat.S_ISDIR(check_own(path, "directory").st_mode):
            raise NotADirectoryError(errno.ENOTDIR, f"{str(path)!r} exists and is not a directory") from None
    os.chmod(path, DIR_MODE)  # mkdir's mode passes through the umask; an old directory may be wider
    return path


def write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path` (0600) whole: to a temporary name first, every byte checked,
    fsynced, then renamed over `path`. If any of it fails, `path` is as it was, the temporary
    file is gone, and IncompleteWrite says how far it got and why."""
    path = Path(path)
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    view, wrote = memoryview(data), 0
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, FILE_MODE)
    except OSError as error:
        raise IncompleteWrite(path, error, 0, len(data)) from error
    try:
        os.fchmod(fd, FILE_MODE)  # a leftover temporary file of ours may have another mode
        while wrote < len(data):
            wrote += os.write(fd, view[wrote:])
        os.fsync(fd)
    except OSError as error:
        os.close(fd)
        _unlink(temp)
        raise IncompleteWrite(path, error, wrote, len(data)) from error
    os.close(fd)
    try:
        os.replace(temp, path)
    except OSError as error:
        _unlink(temp)
        raise IncompleteWrite(path, error, wrote, len(data)) from error


def write_private_json(path: Path, value) -> None:
    write_private(path, json.dumps(value, indent=1).encode())


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def open_own(path: Path) -> int:
    """A descriptor for reading `path`, a file this user owns reached through no link (NotYours
    else); the caller closes it."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as error:
        if error.errno == errno.ELOOP:  # O_NOFOLLOW met a link: say so as check_own does
            check_own(path)
        raise
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            check_own(path)  # raises, naming the owner
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_own(path: Path, offset: int = 0, limit: int | None = None) -> bytes:
    """The bytes of `path` from `offset` on (a negative one counts from the end: a log's last
    lines), a file this user owns and reached through no link (NotYours else). With `limit`, a
    file larger than that is refused (ValueError naming it) before any of it is read."""
    fd = open_own(path)
    try:
        info = os.fstat(fd)
        if limit is not None and info.st_size > limit:
            raise ValueError(f"{str(path)!r} is damaged: {info.st_size:,} bytes, where nbtrain writes at most "
                             f"{limit:,} (not read)")
        if offset:
            os.lseek(fd, offset if offset > 0 else max(0, info.st_size + offset), os.SEEK_SET)
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_own_json(path: Path, limit: int | None = None):
    """`path`'s JSON, read as `read_own` reads; a damaged file is a ValueError naming it."""
    data = read_own(path, limit=limit)
    try:
        return json.loads(data)
    except ValueError as error:
        raise ValueError(f"{str(path)!r} is damaged (not JSON: {error}); "
                         f"{len(data):,} bytes, {'empty' if not data else 'cut or overwritten'}") from None


def new_private_dir(path) -> Path:
    """`path` as a directory: made 0700 (its missing parents too) when it is missing; one that
    is there already (a place the user gave) is left as it is."""
    path = Path(path)
    if not path.is_dir():
        private_dir(path)
    return path


def new_private_file(path) -> Path:
    """`path` made as an empty file, 0600, when missing (for a library that then opens it:
    SQLite gives its journals the database's mode); one that is there is left as it is."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, FILE_MODE))
    return Path(path)


def private_files(directory) -> None:
    """The files of `directory` (not below it) that this user owns, made 0600: what a library
    wrote there with the umask's mode."""
    for entry in os.scandir(directory):
        if entry.is_file(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_uid == os.geteuid():
            os.chmod(entry.path, FILE_MODE)
