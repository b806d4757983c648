"""Where the warm engines live and whether each one is alive: free of torch, so that `fastforward
engine status` and `generate`'s client answer in a blink.

Each engine has a folder `$FASTFORWARD_HOME/engines/<key>` (owner-only), named by what it serves
(`Serves.key`), so engines of different models or precisions coexist and a second engine of the same
is refused. In it: `lock`, held (flock) by the engine process for its whole life, so a killed engine is
known at once, whatever became of its pid; `state.json`, what it serves, whether it is "loading" or
"ready", and `generate`'s flags (`fastforward.cli.warm.flags`); `socket`, the unix socket it answers on once
ready (owner-only); `engine.log`. A folder whose lock nobody holds is stale: its socket and state are
removed on sight (the log stays).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastforward.cli.warm.protocol import messages, send
from fastforward.cli.warm.spec import Serves
from fastforward.errors import FastForwardError
from fastforward.home import fastforward_home

SOCKET_PATH_BYTES = 107  # the longest unix socket path Linux takes (sun_path, less its NUL)
CLAIM_TRIES = 40  # 50 ms apart: a status check holds the lock for microseconds


def root() -> Path:
    return fastforward_home() / "engines"


@dataclass(frozen=True)
class EngineFolder:
    path: Path

    @property
    def key(self) -> str:
        return self.path.name

    @property
    def socket(self) -> Path:
        return self.path / "socket"

    @property
    def state_file(self) -> Path:
        return self.path / "state.json"

    @property
    def log(self) -> Path:
        return self.path / "engine.log"

    @classmethod
    def of(cls, serves: Serves) -> EngineFolder:
        """The folder of the engine that serves `serves`, made owner-only; its socket path checked."""
        folder = cls(root() / serves.key)
        folder.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(root(), 0o700)
        os.chmod(folder.path, 0o700)
        if len(os.fsencode(folder.socket)) > SOCKET_PATH_BYTES:
            raise FastForwardError(
                f"the engine's socket path {folder.socket} is longer than a unix socket takes "
                f"({SOCKET_PATH_BYTES} bytes); set FASTFORWARD_HOME to a shorter folder"
            )
        return folder

    def state(self) -> dict[str, Any] | None:
        """What the engine wrote of itself (None: no engine, or one that died before writing it)."""
        try:
            return json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return None

    def write_state(self, state: dict[str, Any]) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.state_file)

    @contextlib.contextmanager
    def held(self) -> Iterator[bool]:
        """Try the lock: yields True while this process holds it (no engine runs here), False when an
        engine holds it."""
        fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)  # closing releases the lock

    def claim(self) -> int:
        """Take the lock for the life of this process (the engine's): returns its descriptor, kept open.
        Refused when another engine holds it; a checker probing it for an instant is waited out."""
        fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        for _ in range(CLAIM_TRIES):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                time.sleep(0.05)
        os.close(fd)
        state = self.state() or {}
        raise FastForwardError(
            f"an engine for this model and precision runs already (pid {state.get('pid', '?')}); "
            "`fastforward engine stop` stops it"
        )

    def alive(self) -> bool:
        """Whether an engine process holds this folder; a stale one (its engine killed) is cleaned."""
        with self.held() as free:
            if free:
                self.clean()
            return not free

    def clean(self) -> None:
        """Remove the socket and state (an engine's own exit, or a killed engine's leftovers); the log stays."""
        for path in (self.socket, self.state_file):
            path.unlink(missing_ok=True)


def folders() -> list[EngineFolder]:
    """The folders of engines that run (ready or loading), in a stable order; stale ones cleaned on the way."""
    if not root().is_dir():
        return []
    found = [EngineFolder(p) for p in sorted(root().iterdir()) if (p / "state.json").exists()]
    return [folder for folder in found if folder.alive()]


def connect(folder: EngineFolder, timeout: float | None = None) -> socket.socket | None:
    """A connection to the engine's socket, or None when it does not answer (still loading, or killed:
    then its leftovers are cleaned)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(folder.socket))
    except OSError as exc:
        sock.close()
        if exc.errno not in (errno.ENOENT, errno.ECONNREFUSED):
            raise
        folder.alive()  # cleans a dead engine's socket
        return None
    return sock


def ask(folder: EngineFolder, message: dict[str, Any], timeout: float = 5.0) -> dict[str, Any] | None:
    """One request, one answer (None: the engine does not answer)."""
    sock = connect(folder, timeout)
    if sock is None:
        return None
    with sock:
        try:
            send(sock, message)
            return next(messages(sock), None)
        except (OSError, ValueError):
            return None
