"""Where the local chain lives on disk: one JSON file, written atomically, and a lock for its one writer.

A restart keeps the subnet; a second process (``python -m neurons.weights``) reads the same file
read-only and reloads it when it changes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path

from .local_state import ChainState, jsonable

STATE_FILE = "local_chain.json"
LOCK_FILE = "local_chain.lock"


class StateDirLocked(RuntimeError):
    """Another process holds the local chain's state directory for writing."""


class CorruptChainState(RuntimeError):
    """The local chain's state file cannot be read (truncated, hand-edited); it is never reset silently."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}. Move the file aside to start a new local chain (its registrations "
                         "and weights are then gone), or restore it from a copy.")
        self.path = path


class StateFile:
    """The state file of one directory: read, stat, atomic write, and the writer's lock."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self._lock_fd: int | None = None

    @staticmethod
    def find_state_dir(path: str | os.PathLike[str]) -> Path:
        """The directory holding the state file: ``path`` itself or its ``chain/`` child."""
        p = Path(path).expanduser()
        if not (p / STATE_FILE).is_file() and (p / "chain" / STATE_FILE).is_file():
            return p / "chain"
        return p

    def exists(self) -> bool:
        return (self.state_dir / STATE_FILE).is_file()

    def read(self) -> ChainState:
        path = self.state_dir / STATE_FILE
        try:
            return ChainState.from_json(json.loads(path.read_text()))
        except (OSError, UnicodeDecodeError) as e:
            raise CorruptChainState(path, f"cannot read it ({e})") from e
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise CorruptChainState(path, f"not a local chain state ({type(e).__name__}: {e})") from e

    def stat(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.state_dir / STATE_FILE)
        except FileNotFoundError:
            return None
        return st.st_mtime_ns, st.st_size

    @property
    def locked(self) -> bool:
        return self._lock_fd is not None

    def lock(self) -> None:
        """Become the one writer; raises :class:`StateDirLocked` when another process is."""
        if self._lock_fd is not None:
            return
        fd = os.open(self.state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StateDirLocked(
                f"{self.state_dir} is open for writing by another process; open it with read_only=True"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
                os.close(self._lock_fd)
            self._lock_fd = None

    def write(self, state: ChainState) -> None:
        """Replace the file atomically (temporary file, fsync, rename)."""
        target = self.state_dir / STATE_FILE
        tmp = target.with_name(f"{STATE_FILE}.{os.getpid()}.tmp")
        data = json.dumps(state.to_json(), separators=(",", ":"), default=jsonable)
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
