"""Writing files so that a crash, a kill or a full disk never leaves a half-written one in place.

Every file draftsmith writes goes through `write_atomic` (or `save_tensors_atomic` for safetensors):
the bytes go to a temporary name beside the final one, which is then renamed over it (atomic on POSIX).
`swap_directory` does the same for a whole directory.  `require_writable` and `require_free_space`
check a destination before any work is done.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import shutil
import tempfile
import uuid
from pathlib import Path

from safetensors.torch import save_file


class StorageError(OSError):
    """A destination that cannot be written: not writable, or not enough free space."""


def write_atomic(path: str | Path, content: str | bytes) -> None:
    """Write `content` to `path` through a temporary file and a rename."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(content.encode("utf-8") if isinstance(content, str) else content)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        if err.filename is None:            # a failed write() names no file: name the one being written
            raise OSError(err.errno, err.strerror or str(err), str(path)) from None
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def keep_report(write, destination: Path, what: str, text, is_file: bool = False) -> Path:
    """`write(destination)` a report; when that fails (a full disk, a vanished directory) the report is
    written to a fresh temporary directory instead, or else `text()` is printed, and the error (one line)
    says where it went: a measured report is never lost."""
    destination = Path(destination)
    try:
        write(destination)
        return destination
    except OSError as err:
        reason = describe_os_error(err).split(";")[0]
        try:
            fallback = Path(tempfile.mkdtemp(prefix="draftsmith-report-"))
            write(fallback / destination.name if is_file else fallback)
            kept = f"it was written to '{fallback}' instead"
        except OSError:
            print(text(), flush=True)
            kept = "it is printed above instead"
        raise StorageError(err.errno or errno.EIO, f"{what} could not be written to '{destination}' ({reason}); "
                                                   f"{kept}, nothing measured is lost") from None


def save_tensors(tensors: dict, path: str | Path, metadata: dict | None = None) -> None:
    """safetensors' save_file, with the mode any other file gets here (save_file creates 0600 whatever the
    umask, so a serving container running as another user could not read the weights)."""
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~current_umask())


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_tensors_atomic(tensors: dict, path: str | Path, metadata: dict | None = None) -> None:
    """safetensors' save_file (`save_tensors`), through a temporary file and a rename."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        save_tensors(tensors, tmp, metadata=metadata)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def swap_directory(tmp: Path, final: Path) -> None:
    """Put the finished directory `tmp` at `final`; the old `final`, if any, is removed only after."""
    old = final.with_name(final.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def require_writable(path: str | Path, what: str) -> None:
    """Raise StorageError unless a file can be created in directory `path` (created if missing)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".draftsmith-write-probe-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise StorageError(err.errno or errno.EACCES,
                           f"{what} '{path}' is not writable ({err.strerror or err}); choose a directory you "
                           "can write to, or fix its permissions") from None


def free_bytes(path: str | Path) -> int:
    """Free space on the file system that holds `path` (or would, once created)."""
    path = Path(path)
    return shutil.disk_usage(next(p for p in [path, *path.parents] if p.exists())).free


def require_free_space(path: str | Path, needed_bytes: int, what: str,
                       fix: str = "choose another output_dir, or make less data (data.max_conversations)") -> None:
    """Raise StorageError when the file system holding `path` has less than `needed_bytes` free."""
    path = Path(path)
    free = free_bytes(path)
    if free < needed_bytes:
        raise StorageError(errno.ENOSPC,
                           f"{what} needs about {human_size(needed_bytes)} at '{path}', but only {human_size(free)} is free "
                           f"there; free some space, {fix}")


def as_disk_full(err: BaseException, path: Path, what: str, fix: str) -> BaseException:
    """A full disk met while writing `what` at `path` (an OSError, or safetensors' own error for one) as one
    StorageError naming the path and the free space there; any other error as it is."""
    text = str(err)
    full = (isinstance(err, OSError) and err.errno == errno.ENOSPC) or "No space left" in text or "os error 28" in text
    if not full:
        return err
    return StorageError(errno.ENOSPC, f"the disk is full writing {what} at '{path}' ({human_size(free_bytes(path))} "
                                      f"free on that filesystem); {fix}")


def describe_os_error(err: OSError) -> str:
    """One line for a file-system error, naming the path and the fix."""
    if isinstance(err, StorageError):
        return err.strerror or str(err)
    where = f" '{err.filename}'" if err.filename else ""
    if err.errno == errno.ENOSPC:
        directory = Path(err.filename).parent if err.filename else Path.cwd()
        existing = next((p for p in [directory, *directory.parents] if p.exists()), Path.cwd())
        return (f"the disk is full writing{where} ({human_size(shutil.disk_usage(existing).free)} free at "
                f"'{existing}'); free some space or write elsewhere, then run the same command again (finished "
                "data shards and checkpoints are kept, and it continues from them)")
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"cannot write{where}: {err.strerror}; choose a directory you can write to, or fix its permissions"
    return f"{err.strerror or err}{where}"


def human_size(n: float) -> str:
    unit = "bytes"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if n < 1024:
            break
        n, unit = n / 1024, bigger
    return f"{n:.0f} bytes" if unit == "bytes" else f"{n:.1f} {unit}"


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def directory_lock_pid(directory: Path, name: str = ".lock") -> int | None:
    """The process id recorded in `directory`'s lock file (DirectoryLock), if any."""
    try:
        return int((directory / name).read_text().strip() or 0) or None
    except (OSError, ValueError):
        return None


_HELD: dict[str, tuple[int, int]] = {}     # resolved directory -> (file descriptor, depth)
UNSUPPORTED_LOCKS = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP)     # flock refused by the filesystem itself


class DirectoryLock:
    """An exclusive lock on a run directory (`.lock`, flock), held by one process at a time.

    Re-entrant within a process (the quickstart makes data and trains under one lock).  A second
    process gets a StorageError naming the holder's process id.  `name`: the lock file's name in `directory`
    (another name locks something beside the directory's own work, e.g. one export folder in its parent)."""

    def __init__(self, directory: str | Path, what: str, name: str = ".lock", subject: str | Path | None = None):
        self.directory, self.what, self.name = Path(directory), what, name
        self.subject = subject or directory          # what the message names as busy

    def _key(self) -> str:
        return str(self.directory.resolve() / self.name)

    def __enter__(self):
        self.directory.mkdir(parents=True, exist_ok=True)
        key = self._key()
        if key in _HELD:
            fd, depth = _HELD[key]
            _HELD[key] = (fd, depth + 1)
            return self
        fd = os.open(self.directory / self.name, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if isinstance(err, BlockingIOError):
                os.close(fd)
                raise self._busy() from None
            os.close(fd)
            if err.errno in UNSUPPORTED_LOCKS:     # the filesystem has no flock: say so, not a traceback
                raise StorageError(err.errno, f"the filesystem of '{self.directory}' does not support file locks "
                                              f"(flock: {err.strerror or err}); mount it with lock support (Lustre: "
                                              "-o flock; NFS: lockd, or NFSv4), or choose an output_dir on a "
                                              "filesystem that has them") from None
            raise
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        _HELD[key] = (fd, 1)
        return self

    def _busy(self) -> StorageError:
        holder = directory_lock_pid(self.directory, self.name)
        return StorageError(errno.EBUSY, f"'{self.subject}' is in use by another draftsmith process"
                            + (f" (pid {holder})" if holder else "")
                            + f"; wait for it to finish, or give this {self.what} another output_dir")

    def __exit__(self, *exc):
        key = self._key()
        fd, depth = _HELD[key]
        if depth > 1:
            _HELD[key] = (fd, depth - 1)
            return
        del _HELD[key]
        os.close(fd)        # releases the flock; the file stays (a stale pid in it means nothing)
