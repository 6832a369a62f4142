"""CurveZMQ key material of one job, made at launch into ``runs/<job>/keys/``.

Two keypairs, each key one Z85 text file (40 characters and a newline)::

    server.public  server.secret      the coordinator's; server.secret never leaves its host
    client.public  client.secret      ONE pair shared by every peer of the job (ranks, top, CLI)

A single client pair keeps authentication a set-membership test (is this the job's key?) and
lets the launcher push the same three files (all but server.secret) to every host: a rank's
keys folder holds ``server.public`` and the client pair only, and :func:`load_job_keys` then
returns a ``server_secret`` of None. Files are created 0600 (exclusively, so a relaunch never
swaps keys under running peers) in a 0700 folder.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq

log = logging.getLogger(__name__)

SERVER_PUBLIC, SERVER_SECRET = "server.public", "server.secret"
CLIENT_PUBLIC, CLIENT_SECRET = "client.public", "client.secret"


class BusKeyError(RuntimeError):
    """Key material missing, unreadable or malformed."""


@dataclass(frozen=True)
class JobKeys:
    """Z85-encoded (40-byte) CURVE keys of a job; ``server_secret`` only on the coordinator."""

    server_public: bytes
    client_public: bytes
    client_secret: bytes
    server_secret: bytes | None = None

    def __repr__(self) -> str:  # keep secrets out of logs and tracebacks
        return f"JobKeys(server_public={self.server_public!r}, client_public=" \
               f"{self.client_public!r}, has_server_secret={self.server_secret is not None})"


def make_job_keys(keys_dir: str | Path) -> JobKeys:
    """Generate the job's server and client keypairs into ``keys_dir`` (0700, files 0600)."""
    folder = Path(keys_dir)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.chmod(0o700)
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    for name, key in ((SERVER_PUBLIC, server_public), (SERVER_SECRET, server_secret),
                      (CLIENT_PUBLIC, client_public), (CLIENT_SECRET, client_secret)):
        _write_private(folder / name, key)
    return JobKeys(server_public=server_public, client_public=client_public,
                   client_secret=client_secret, server_secret=server_secret)


def load_job_keys(keys_dir: str | Path) -> JobKeys:
    """The keys in ``keys_dir``; ``server_secret`` is None where that file is absent (a rank)."""
    folder = Path(keys_dir)
    secret_path = folder / SERVER_SECRET
    return JobKeys(server_public=_read_key(folder / SERVER_PUBLIC),
                   client_public=_read_key(folder / CLIENT_PUBLIC),
                   client_secret=_read_key(folder / CLIENT_SECRET),
                   server_secret=_read_key(secret_path) if secret_path.exists() else None)


def _write_private(path: Path, key: bytes) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise BusKeyError(f"{path} already exists: a job's keys are made once, at launch "
                          "(use load_job_keys, or a new job folder)") from None
    with os.fdopen(fd, "wb") as handle:
        handle.write(key + b"\n")


def _read_key(path: Path) -> bytes:
    try:
        mode = path.stat().st_mode
        key = path.read_bytes().strip()
    except OSError as exc:
        raise BusKeyError(f"cannot read bus key {path}: {exc.strerror}") from None
    if len(key) != 40:
        raise BusKeyError(f"bus key {path}: expected 40 Z85 characters, got {len(key)}")
    if path.name.endswith(".secret") and mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("bus key %s is readable by others (mode %o); expected 0600", path,
                    stat.S_IMODE(mode))
    return key
