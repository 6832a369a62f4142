"""CurveZMQ key material of one job, made at launch into ``runs/<job>/keys/``.

One keypair per peer, each key one Z85 text file (40 characters and a newline)::

    server.public    server.secret      the coordinator's; server.secret never leaves its host
    rank-<r>.public  rank-<r>.secret    rank r's, for each rank of the job
    operator.public  operator.secret    the launcher's follower, ``tiderl top`` and ``rebalance``
    http.secret                         not a bus key: the job's HTTP tokens (tiderl.auth)

A key proves who its holder is: the coordinator's ZAP handler names each admitted key's owner
("rank-3", "operator") and the bus server checks every message against that name (a rank speaks
only as itself, the operator only sends operator messages; :mod:`tiderl.runtime.bus.gatekeeper`).
So a peer's host holds its own pair only: the SSH launcher pushes ``server.public`` and the pairs
of the ranks on each node, ``server.secret`` and every ``*.public`` to the coordinator's node,
and keeps ``operator.secret`` on the launcher's machine. ``http.secret`` is shared on purpose
(every node with a rank, an engine server or the environment service): a bearer token is one
value that all of them present or check.

:func:`load_job_keys` gives a peer its :class:`JobKeys` and the coordinator its
:class:`ServerKeys` (its pair and every peer's public key). Files are created 0600, exclusively
(a relaunch never swaps keys under running peers), in a 0700 folder.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, overload

import zmq

from tiderl.core.quote import short

log = logging.getLogger(__name__)

SERVER_PUBLIC, SERVER_SECRET = "server.public", "server.secret"
HTTP_SECRET = "http.secret"
OPERATOR = "operator"  # the peer name of the operator pair (top, rebalance, the launcher)
COORDINATOR = "coordinator"  # load_job_keys' peer for the server's side
_RANK_NAME = re.compile(r"rank-(0|[1-9][0-9]*)")


class BusKeyError(RuntimeError):
    """Key material missing, unreadable or malformed."""


def peer_name(peer: int | str) -> str:
    """The name of a peer's key files and ZAP User-Id: ``rank-<r>`` for rank r, or "operator"
    (a rank's name is also its ROUTER identity, :func:`sockets.rank_identity`)."""
    if isinstance(peer, int) and not isinstance(peer, bool) and peer >= 0:
        return f"rank-{peer}"
    if peer == OPERATOR:
        return OPERATOR
    raise BusKeyError(f"bus keys: no peer {short(peer)} (a rank number >= 0 or {short(OPERATOR)})")


def rank_of(name: str) -> int | None:
    """The rank a peer name belongs to (``rank-3`` -> 3); None for the operator."""
    match = _RANK_NAME.fullmatch(name)
    return None if match is None else int(match.group(1))


@dataclass(frozen=True)
class JobKeys:
    """One peer's Z85 (40-byte) keys: the coordinator's public key and the peer's own pair."""

    server_public: bytes
    peer: str  # "rank-<r>" or "operator"
    public: bytes
    secret: bytes

    def __repr__(self) -> str:  # keep secrets out of logs and tracebacks
        return f"JobKeys(peer={self.peer!r}, public={self.public!r})"


@dataclass(frozen=True)
class ServerKeys:
    """The coordinator's: its own pair and every peer's public key (peer name -> Z85 key)."""

    server_public: bytes
    server_secret: bytes
    peers: dict[str, bytes]

    def __repr__(self) -> str:
        return f"ServerKeys(server_public={self.server_public!r}, peers={sorted(self.peers)})"


def make_job_keys(keys_dir: str | Path, num_ranks: int) -> ServerKeys:
    """Generate the server pair, one pair per rank, the operator pair and the HTTP secret into
    ``keys_dir`` (0700, files 0600); the coordinator's view of them."""
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise BusKeyError(f"make_job_keys: num_ranks must be an int >= 1, got {num_ranks!r}")
    folder = Path(keys_dir)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.chmod(0o700)
    server_public, server_secret = zmq.curve_keypair()
    peers: dict[str, bytes] = {}
    files = [(SERVER_PUBLIC, server_public), (SERVER_SECRET, server_secret),
             (HTTP_SECRET, secrets.token_hex(32).encode())]
    for name in [*(peer_name(r) for r in range(num_ranks)), OPERATOR]:
        public, secret = zmq.curve_keypair()
        peers[name] = public
        files += [(f"{name}.public", public), (f"{name}.secret", secret)]
    for name, key in files:
        _write_private(folder / name, key)
    return ServerKeys(server_public=server_public, server_secret=server_secret, peers=peers)


@overload
def load_job_keys(keys_dir: str | Path, peer: Literal["coordinator"]) -> ServerKeys: ...


@overload
def load_job_keys(keys_dir: str | Path, peer: int | Literal["operator"]) -> JobKeys: ...


def load_job_keys(keys_dir: str | Path, peer: int | str) -> JobKeys | ServerKeys:
    """The keys of ``peer`` in ``keys_dir``: a rank number or "operator" (a :class:`JobKeys`),
    or "coordinator" (:class:`ServerKeys`: ``server.secret`` and every ``<peer>.public``)."""
    folder = Path(keys_dir)
    server_public = _read_key(folder / SERVER_PUBLIC)
    if peer == COORDINATOR:
        return ServerKeys(server_public=server_public,
                          server_secret=_read_key(folder / SERVER_SECRET),
                          peers=_peer_publics(folder))
    name = peer_name(peer)
    return JobKeys(server_public=server_public, peer=name,
                   public=_read_key(folder / f"{name}.public"),
                   secret=_read_key(folder / f"{name}.secret"))


def _peer_publics(folder: Path) -> dict[str, bytes]:
    peers: dict[str, bytes] = {}
    for path in sorted(folder.glob("*.public")):
        name = path.name.removesuffix(".public")
        if name == "server":
            continue
        if name != OPERATOR and rank_of(name) is None:
            raise BusKeyError(f"bus key {path}: not a peer's key (rank-<r>.public or "
                              f"{OPERATOR}.public)")
        peers[name] = _read_key(path)
    if not peers:
        raise BusKeyError(f"bus keys {folder}: no peer's public key (rank-<r>.public, "
                          f"{OPERATOR}.public); the coordinator would admit no one")
    return peers


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
