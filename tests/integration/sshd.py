"""A real OpenSSH server on loopback for the SSH launch tests: a generated host key, key-only
login for the current user, its own config (``StrictModes no``: the keys sit under the test's
tmp folder). Each ``sshd`` is one "node" of a hosts.yaml; two ports make two nodes.

Without ``/usr/sbin/sshd`` the tests skip, except under CI (``CI`` set), where they fail:
``.ci/run`` installs openssh-server.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.serving import free_port, stop_process

SSHD = Path("/usr/sbin/sshd")


def require_sshd() -> None:
    missing = [str(p) for p in (SSHD, Path("/usr/bin/ssh-keygen")) if not p.exists()]
    if not missing:
        return
    why = f"{', '.join(missing)} not installed (apt-get install openssh-server)"
    if os.environ.get("CI"):
        pytest.fail(f"CI must run the SSH tests: {why}")
    pytest.skip(why)


@dataclass(frozen=True)
class SSHNode:
    host: str
    port: int
    user: str
    key_file: Path


def client_key(folder: Path) -> Path:
    """The test client's ed25519 key (made once per folder)."""
    key = folder / "client_ed25519"
    if not key.exists():
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)],
                       check=True)
    return key


@contextlib.contextmanager
def sshd(folder: Path, key: Path) -> Iterator[SSHNode]:
    """An sshd on 127.0.0.1:<free port> that admits ``key``; stopped on exit."""
    require_sshd()
    folder.mkdir(parents=True, exist_ok=True)
    host_key = folder / "host_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key)],
                   check=True)
    authorized = folder / "authorized_keys"
    authorized.write_text(Path(f"{key}.pub").read_text())
    authorized.chmod(0o600)
    port = free_port()
    config = folder / "sshd_config"
    config.write_text("\n".join([
        "ListenAddress 127.0.0.1", f"Port {port}", f"HostKey {host_key}",
        f"PidFile {folder / 'sshd.pid'}", f"AuthorizedKeysFile {authorized}",
        "PasswordAuthentication no", "KbdInteractiveAuthentication no",
        "PermitRootLogin prohibit-password", "PubkeyAuthentication yes", "UsePAM no",
        "StrictModes no", "Subsystem sftp internal-sftp", "MaxStartups 64", "MaxSessions 64",
        "LogLevel VERBOSE", ""]))
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # its privilege separation dir
    log = folder / "sshd.log"
    proc = subprocess.Popen([str(SSHD), "-D", "-f", str(config), "-E", str(log)])
    try:
        _wait_listening(port, proc, log)
        yield SSHNode("127.0.0.1", port, getpass.getuser(), key)
    finally:
        stop_process(proc)


def _wait_listening(port: int, proc: subprocess.Popen, log: Path, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"sshd exited: {log.read_text() if log.exists() else ''}"
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.05)
    raise AssertionError(f"sshd did not listen on {port} within {timeout_s:.0f} s")
