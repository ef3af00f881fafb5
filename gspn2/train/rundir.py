"""The run directory's guarantees: one trainer at a time, epoch artefacts published as one set, and the
recovery a start performs after a crash.

* :class:`RunDirLock` -- an exclusive ``flock`` on ``<run_dir>/train.lock`` for the life of a run. The
  kernel drops the lock when its process dies (kill -9 included), so a lock file left behind by a dead
  trainer is recognised as stale and taken over; a live holder makes a second trainer stop with a
  message naming it.
* :func:`publish` -- the files of one epoch (``last.pt``, ``best.pt``, ``results.json``, ...) are first
  written complete into ``<run_dir>/.staged/``, then a manifest is committed atomically, then every file
  is renamed into place. :func:`recover` on the next start completes a committed set and discards an
  uncommitted one, so after a crash at any point the directory holds one epoch's set or the previous
  one's, never a mix.
* :func:`recover` also deletes the ``.*.tmp`` files an interrupted atomic write leaves behind.
* :class:`InterruptsDeferred` -- a Ctrl-C that arrives while checkpoints are written takes effect once
  they are complete, so the checkpoint an interrupted run names is the newest one.
* :func:`resume_point` -- which checkpoint a start continues from, with the way out when the run's own
  ``last.pt`` is damaged.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from gspn2.train.checkpoint import CheckpointError, atomic_write_bytes, load_checkpoint

__all__ = [
    "LOCK_NAME",
    "STAGING_NAME",
    "InterruptsDeferred",
    "RunDirError",
    "RunDirBusy",
    "RunDirLock",
    "publish",
    "recover",
    "ResumePoint",
    "resume_point",
    "set_aside",
]

LOCK_NAME = "train.lock"
STAGING_NAME = ".staged"
_MANIFEST = "COMMITTED"


class RunDirError(RuntimeError):
    """The run directory can not be used."""


class RunDirBusy(RunDirError):
    """Another live trainer holds the run directory."""


class InterruptsDeferred:
    """``with InterruptsDeferred("the epoch's checkpoint"):`` holds a Ctrl-C (SIGINT) that arrives inside
    the block until the block is done, then raises :class:`KeyboardInterrupt`; a second Ctrl-C raises at
    once, abandoning the write (whatever error the abandoned write then raises becomes that
    KeyboardInterrupt's cause).

    Without it a Ctrl-C lands inside ``torch.save`` and the zip writer's cleanup replaces the
    KeyboardInterrupt with its own error. Acts only in the main thread and only while SIGINT has
    Python's default handler; anywhere else the block runs unchanged.
    """

    def __init__(self, what: str):
        self.what = what
        self.received = 0
        self._previous = None

    def _hold(self, signum, frame) -> None:
        self.received += 1
        if self.received > 1:
            raise KeyboardInterrupt
        print(f"\nCtrl-C: finishing {self.what} first (Ctrl-C again to abandon it)", file=sys.stderr)

    def __enter__(self) -> InterruptsDeferred:
        main = threading.current_thread() is threading.main_thread()
        if main and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous = signal.signal(signal.SIGINT, self._hold)
        return self

    def __exit__(self, kind, error, tb) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
        if kind is not None and issubclass(kind, KeyboardInterrupt):
            return
        if kind is not None and self.received > 1:
            raise KeyboardInterrupt from error  # the abandoned write's own error, caused by the Ctrl-C
        if kind is None and self.received:
            raise KeyboardInterrupt


def _fsync_dir(path: Path) -> None:
    """Make renames and unlinks inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class RunDirLock:
    """Exclusive lock of a run directory; create it with :meth:`acquire`, drop it with :meth:`release`.

    Directories that :meth:`acquire` had to create are removed again by :meth:`release` if they are
    still empty, so a start that fails before writing anything leaves no trace.
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None
        self._created: list[Path] = []

    def acquire(self) -> str | None:
        """Take the lock; returns a note when a stale lock of a dead trainer was taken over.

        Raises :class:`RunDirBusy` when a live process holds it, :class:`RunDirError` when the
        filesystem can not lock.
        """
        missing, d = [], self.run_dir
        while not d.exists():
            missing.append(d)
            d = d.parent
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._created = missing  # deepest first
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                self._remove_created()
                raise RunDirBusy(self._busy_message(holder)) from None
            except OSError as e:
                os.close(fd)
                self._remove_created()
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise RunDirError(
                        f"cannot lock the run directory {str(self.run_dir)!r}: its filesystem does not "
                        f"support flock ({e.strerror}); put run_dir on a filesystem that does (NFS and "
                        f"Lustre need their flock mount options)"
                    ) from e
                raise
            # a holder that released between our open and our flock has unlinked the file we opened:
            # lock the file the path names now, or two trainers could each hold a lock on a different file
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        previous = _read_holder(fd)
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.datetime.now().isoformat(timespec="seconds"),
            "argv": sys.argv,
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        if previous:
            return (
                f"took over the stale lock {self.path} of a trainer that is no longer running "
                f"({_describe_holder(previous)})"
            )
        return None

    def _busy_message(self, holder: dict[str, Any]) -> str:
        msg = (
            f"run directory {str(self.run_dir)!r} is in use by another trainer "
            f"({_describe_holder(holder)}; lock file {self.path}). Two trainers in one run directory "
            f"would overwrite each other's checkpoints: wait for it to finish, stop it, or choose "
            f"another run_dir=..."
        )
        pid, host = holder.get("pid"), holder.get("host")
        if isinstance(pid, int) and host == socket.gethostname() and not _pid_alive(pid):
            msg += (
                f" (process {pid} itself has exited, but processes it started -- DataLoader workers -- "
                f"still hold the lock; they exit within seconds, then retry)"
            )
        return msg

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            # unlink while still holding the lock: a waiting trainer then re-checks and locks a new file
            if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                os.unlink(self.path)
        except FileNotFoundError:
            pass  # removed by hand; nothing left to unlink
        finally:
            os.close(fd)
        self._remove_created()

    def _remove_created(self) -> None:
        for d in self._created:  # deepest first; stop at the first that holds anything
            if not d.is_dir() or any(d.iterdir()):
                break
            d.rmdir()
        self._created = []

    def __enter__(self) -> "RunDirLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> dict[str, Any]:
    data = os.pread(fd, 65536, 0)
    if not data:
        return {}
    try:
        holder = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {"unreadable": data[:80].decode("utf-8", "replace")}
    return holder if isinstance(holder, dict) else {"unreadable": str(holder)[:80]}


def _describe_holder(holder: dict[str, Any]) -> str:
    if not holder:
        return "holder unknown"
    if "unreadable" in holder:
        return f"lock file content {holder['unreadable']!r}"
    return f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"


# ---------------------------------------------------------------------------------- publish, recover


def publish(
    run_dir: str | os.PathLike,
    files: Mapping[str, Callable[[Path], None] | str],
    remove: Sequence[str] = (),
    label: str = "",
) -> None:
    """Replace a set of files in ``run_dir`` as one unit.

    Args:
        files: ``name -> writer``; ``writer(path)`` writes the complete file at ``path``. A ``str`` value
            names another entry of ``files`` to copy (``"best.pt": "last.pt"``): a copy rather than a
            hard link, so damage to one file on disk does not reach the other.
        remove: names deleted from ``run_dir`` in the same unit (e.g. a checkpoint that left a top-k).
        label: what the set is (``"epoch 3"``), for the messages of :func:`recover`.

    A writer that raises leaves the published files as they were (the staged ones are deleted); a crash
    at any point is completed or rolled back by :func:`recover` on the next start.
    """
    run_dir = Path(run_dir)
    for name in [*files, *remove]:
        if not name or "/" in name or name.startswith(".") or name in (LOCK_NAME, STAGING_NAME):
            raise ValueError(f"publish: {name!r} is not a plain file name of the run directory")
    staging = run_dir / STAGING_NAME
    _settle_staging(run_dir)  # a set an earlier call committed but could not finish moving goes first
    staging.mkdir(parents=True)
    try:
        for name, writer in files.items():
            if isinstance(writer, str):
                if writer not in files or isinstance(files[writer], str):
                    raise ValueError(f"publish: {name!r} copies {writer!r}, which is not a written entry")
                with open(staging / writer, "rb") as src, open(staging / name, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                    dst.flush()
                    os.fsync(dst.fileno())
            else:
                writer(staging / name)
        _fsync_dir(staging)
        manifest = {"files": list(files), "remove": list(remove), "label": label}
        atomic_write_bytes(staging / _MANIFEST, json.dumps(manifest).encode())
        _fsync_dir(staging)
    except BaseException:
        shutil.rmtree(staging)  # nothing was published: the previous set stays whole
        raise
    _roll_forward(run_dir, manifest)


def _roll_forward(run_dir: Path, manifest: dict[str, Any]) -> list[str]:
    """Move the staged files of a committed manifest into place (idempotent: a file already moved by an
    interrupted earlier attempt is absent from the staging folder)."""
    staging = run_dir / STAGING_NAME
    moved = []
    for name in manifest["files"]:
        if (staging / name).exists():
            os.replace(staging / name, run_dir / name)
            moved.append(name)
    for name in manifest["remove"]:
        if (run_dir / name).exists():
            os.unlink(run_dir / name)
    _fsync_dir(run_dir)
    shutil.rmtree(staging)
    return moved


def _settle_staging(run_dir: Path) -> str | None:
    """Complete a committed staged set, delete an uncommitted one; a message says which."""
    staging = run_dir / STAGING_NAME
    if not staging.is_dir():
        return None
    manifest_path = staging / _MANIFEST
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        moved = _roll_forward(run_dir, manifest)
        return (
            f"completed the interrupted write of {manifest.get('label') or 'the epoch artefacts'} "
            f"in {run_dir} (moved into place: {', '.join(moved) or 'nothing left to move'})"
        )
    names = sorted(p.name for p in staging.iterdir())
    shutil.rmtree(staging)
    return (
        f"discarded an incomplete write of epoch artefacts in {run_dir} ({', '.join(names) or 'empty'}): "
        f"the run continues from the previous epoch's set"
    )


def recover(run_dir: str | os.PathLike) -> list[str]:
    """Bring ``run_dir`` back to one consistent set of epoch artefacts after a crash; call it with the
    lock held, before reading anything. Returns one message per action taken (nothing to do: ``[]``)."""
    run_dir = Path(run_dir)
    note = _settle_staging(run_dir)
    notes = [note] if note else []
    for tmp in sorted(run_dir.glob(".*.tmp")):
        if tmp.is_file():
            tmp.unlink()
            notes.append(f"removed {tmp}, left by an interrupted write")
    return notes


# ------------------------------------------------------------------------------------ resume point


@dataclass
class ResumePoint:
    """Where a start continues from: ``path`` and its loaded ``state`` (both None: from scratch);
    ``damaged_last``: the run's own ``last.pt``, refused, to be set aside before the first write."""

    path: Path | None = None
    state: dict[str, Any] | None = None
    damaged_last: Path | None = None


def resume_point(run_dir: str | os.PathLike, resume: str | os.PathLike | None) -> ResumePoint:
    """The run's own ``last.pt`` if it exists, else ``resume`` (if given), loaded and verified.

    A damaged own ``last.pt`` stops the start with :class:`CheckpointError` naming the ways out, unless
    ``resume`` names another checkpoint: then the run continues from that one and the damaged file is
    kept (see :func:`set_aside`). Nothing is written here.
    """
    run_dir = Path(run_dir)
    own = run_dir / "last.pt"
    explicit = Path(resume) if resume else None
    if own.exists():
        try:
            return ResumePoint(own, load_checkpoint(own))
        except CheckpointError as e:
            if explicit is None or (explicit.exists() and explicit.resolve() == own.resolve()):
                raise CheckpointError(f"{e}. {_way_out(run_dir)}") from e
            return ResumePoint(explicit, load_checkpoint(explicit), damaged_last=own)
    if explicit is not None:
        return ResumePoint(explicit, load_checkpoint(explicit))
    return ResumePoint()


def _way_out(run_dir: Path) -> str:
    best = run_dir / "best.pt"
    options = []
    if best.is_file():
        options.append(f"continue from the best epoch's checkpoint with resume={best}")
    options.append("continue from another checkpoint with resume=<file>")
    return (
        f"Nothing in {run_dir} was changed. To go on, re-run with the same run_dir and "
        + " or ".join(options)
        + f" (the damaged last.pt is then kept as {_aside_name(run_dir / 'last.pt').name}),"
        + " or use a new run_dir"
    )


def _aside_name(path: Path) -> Path:
    candidate = path.with_name(f"{path.stem}.damaged{path.suffix}")
    n = 1
    while candidate.exists():
        candidate = path.with_name(f"{path.stem}.damaged-{n}{path.suffix}")
        n += 1
    return candidate


def set_aside(path: str | os.PathLike) -> Path:
    """Rename a refused checkpoint to ``<stem>.damaged[-N]<suffix>`` next to it; returns the new path."""
    path = Path(path)
    target = _aside_name(path)
    os.rename(path, target)
    return target
