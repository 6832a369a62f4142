"""One SSH session per node (fabric): checks, file pushes, detached starts, process control.

Daemons start detached with all three streams redirected and their own session, a node's in
one command::

    cd WORKDIR; K=V setsid nohup CMD > LOG 2>&1 < /dev/null & echo $!; K=V setsid nohup ...

so ``$!`` is the daemon itself (not a subshell holding the channel), it leads its own process
group (``tiderl stop`` signals the group) and it outlives the SSH connection. Liveness is the
process state read from ``/proc/PID/stat`` over SFTP (a killed process that is not reaped yet
is a zombie, which ``kill -0`` would still call alive); stopping runs on the node as
``python -m tiderl.launch.nodectl stop``, the same code the local executor uses.

Every failure is a :class:`NodeError`: one line naming the node.
"""

from __future__ import annotations

import json
import os
import posixpath
import shlex
import socket
import stat
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import paramiko
from fabric import Config, Connection
from invoke.exceptions import CommandTimedOut

from tiderl import __version__
from tiderl.launch.hosts import Node
from tiderl.launch.local import LaunchError, stat_state
from tiderl.launch.nodectl import last_answer, read_model_answer
from tiderl.models.hub import MODEL_TIMEOUT_S, Resolved

CONNECT_TIMEOUT_S = 10
COMMAND_TIMEOUT_S = 60
STATE_READS, STATE_REREAD_S = 3, 0.05  # a process state read SFTP failed is read again

# what the node's python reports: its version, tiderl's, and the absolute workdir
_CHECK = ("import json, os, sys\n"
          "try:\n    import tiderl; v = tiderl.__version__\n"
          "except ImportError:\n    v = None\n"
          "print(json.dumps({'python': list(sys.version_info[:2]), 'tiderl': v, "
          "'workdir': os.getcwd()}))")


class NodeError(LaunchError):
    """An SSH or node failure; the message names the node."""


class NodeSession:
    """An open SSH connection to one node of hosts.yaml."""

    def __init__(self, node: Node, connect_timeout_s: float = CONNECT_TIMEOUT_S):
        self.node = node
        key = os.path.expanduser(node.key_file) if node.key_file else None
        kwargs: dict = {"banner_timeout": connect_timeout_s, "auth_timeout": connect_timeout_s}
        if key is not None:  # that key only: a wrong key must fail, not fall back to others
            kwargs.update(key_filename=key, look_for_keys=False, allow_agent=False)
        self.conn = Connection(node.host, user=node.user, port=node.port,
                               connect_timeout=int(connect_timeout_s), connect_kwargs=kwargs,
                               config=Config(overrides={"load_ssh_configs": False}))

    def fail(self, why: str) -> NodeError:
        return NodeError(f"node {self.node.name} ({self.node.target}): {why}")

    def open(self) -> NodeSession:
        key = self.node.key_file
        if key is not None and not Path(os.path.expanduser(key)).is_file():
            raise self.fail(f"key_file {key}: no such file")
        try:
            self.conn.open()
        except paramiko.AuthenticationException:
            with_key = f"key {key}" if key else "the default keys"
            raise self.fail(f"SSH login refused with {with_key}") from None
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise self.fail(f"unreachable ({_reason(exc)})") from None
        return self

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> NodeSession:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- commands

    def run(self, command: str, timeout_s: float = COMMAND_TIMEOUT_S,
            check: bool = True) -> tuple[int, str, str]:
        """(exit code, stdout, stderr) of a shell command on the node."""
        try:
            result = self.conn.run(command, hide=True, warn=True, in_stream=False,
                                   timeout=timeout_s)
        except CommandTimedOut:
            raise self.fail(f"{command.split()[0]} did not finish in {timeout_s:.0f} s") from None
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise self.fail(f"lost the connection ({_reason(exc)})") from None
        if check and result.exited != 0:
            last = (result.stderr.strip() or result.stdout.strip()).splitlines()
            raise self.fail(f"{command.split()[0]} failed (exit {result.exited}): "
                            f"{last[-1] if last else 'no output'}")
        return result.exited, result.stdout, result.stderr

    def python(self, args: str, timeout_s: float = COMMAND_TIMEOUT_S) -> str:
        return self.run(f"{shlex.quote(self.node.python)} {args}", timeout_s)[1]

    def check(self) -> str:
        """The node's python and tiderl must match the launcher's; returns the absolute
        workdir (created if missing)."""
        py, workdir = shlex.quote(self.node.python), shlex.quote(self.node.workdir)
        code, out, err = self.run(f"mkdir -p {workdir} && cd {workdir} && "
                                  f"{py} -c {shlex.quote(_CHECK)}", check=False)
        if code == 127 or "No such file" in err:
            raise self.fail(f"python {self.node.python}: not found")
        if code != 0:
            last = (err.strip() or out.strip()).splitlines()
            raise self.fail(f"could not run python {self.node.python} in {self.node.workdir}: "
                            f"{last[-1] if last else f'exit {code}'}")
        try:
            info = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise self.fail(f"python {self.node.python} printed {out.strip()[:80]!r}") from None
        here = list(sys.version_info[:2])
        if info["tiderl"] is None:
            raise self.fail(f"tiderl is not installed for {self.node.python} "
                            f"(the launcher has tiderl {__version__})")
        if info["python"] != here or info["tiderl"] != __version__:
            there = f"python {'.'.join(map(str, info['python']))}, tiderl {info['tiderl']}"
            raise self.fail(f"{there} differ from the launcher's (python "
                            f"{'.'.join(map(str, here))}, tiderl {__version__})")
        return info["workdir"]

    def nodectl(self, args: str, timeout_s: float = COMMAND_TIMEOUT_S) -> tuple[str, str]:
        """``python -m tiderl.launch.nodectl ARGS`` in the node's workdir, whatever its exit
        code: its stdout (the answer on its last line) and the last line of its stderr."""
        _, out, err = self.run(f"cd {shlex.quote(self.node.workdir)} && "
                               f"{shlex.quote(self.node.python)} -m tiderl.launch.nodectl "
                               f"{args}", timeout_s, check=False)
        last = err.strip().splitlines()
        return out, last[-1] if last else "no output"

    def resolve_model(self, path: str, revision: str) -> Resolved:
        """A hub id resolved on this node, into its own cache (downloaded there when missing,
        ``MODEL_TIMEOUT_S`` at most); HubError naming the node."""
        out, why = self.nodectl(f"model {shlex.quote(path)} --revision {shlex.quote(revision)}",
                                MODEL_TIMEOUT_S)
        resolved = read_model_answer(out, self.node.name)
        if resolved is None:
            raise self.fail(f"could not resolve model.path {path}: {why}")
        return resolved

    def free_ports(self, count: int) -> list[int]:
        """``count`` distinct ports free to listen on at this node, outside its ephemeral range
        where it leaves enough (``tiderl.ports``); NodeError naming the node when it has too
        few or its tiderl gives no answer."""
        host = self.node.reach if _is_ip(self.node.reach) else "0.0.0.0"
        out, why = self.nodectl(f"ports {count} --host {shlex.quote(host)}")
        answer = last_answer(out)
        if isinstance(answer, list):
            return answer
        if isinstance(answer, dict) and answer.get("error"):
            raise self.fail(str(answer["error"]))
        raise self.fail(f"`nodectl ports` gave no answer (is the node's tiderl this one's?): "
                        f"{why}")

    def push(self, files: Mapping[str, tuple[bytes, int]], dirs: Sequence[str] = ()) -> None:
        """Write ``{remote path: (content, mode)}`` (folders in ``dirs`` are made 0700, as
        ``mkdir -p`` would, their parents too), all over SFTP."""
        path = ""
        try:
            sftp = self.conn.sftp()
            for path in dirs:
                _make_dirs(sftp, path)
                sftp.chmod(path, 0o700)
            for path, (content, mode) in files.items():
                with sftp.open(path, "wb") as handle:
                    handle.chmod(mode)  # before the content: a secret is never world-readable
                    handle.write(content)
        except (OSError, paramiko.SSHException) as exc:
            raise self.fail(f"could not write {path} over SFTP ({_reason(exc)})") from None

    def start(self, starts: Sequence[tuple[Sequence[str], Mapping[str, str], str]]) -> list[int]:
        """Start each ``(argv, env, log)`` detached (see the module docstring), all in one
        command (each command starts the login shell on the node, with its ~/.bashrc);
        returns their PIDs in order."""
        lines = [f"cd {shlex.quote(self.node.workdir)}"]
        for argv, env, log in starts:
            assign = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
            command = " ".join(shlex.quote(a) for a in argv)
            lines.append(f"{assign} setsid nohup {command} > {shlex.quote(log)} 2>&1 "
                         "< /dev/null & echo $!")
        out = self.run("; ".join(lines))[1].split()
        if len(out) != len(starts) or not all(pid.isdigit() for pid in out):
            names = ", ".join(argv[0] for argv, _, _ in starts)
            raise self.fail(f"starting {names} printed {' '.join(out)[:80]!r}, not "
                            f"{len(starts)} PIDs")
        return [int(pid) for pid in out]

    def states(self, pids: Sequence[int]) -> dict[int, str | None]:
        """Each PID's state letter on the node (None: no such process), read from
        ``/proc/PID/stat`` over the session's SFTP channel: the launcher polls this every
        second, and a command would start the user's shell on the node each time, with its
        ~/.bashrc (0.4-0.6 s on the development machine, whose ~/.bashrc runs pyenv init)."""
        return {pid: self._state(int(pid)) for pid in pids}

    def _state(self, pid: int) -> str | None:
        path = f"/proc/{pid}/stat"
        for attempt in range(STATE_READS):
            if attempt:
                time.sleep(STATE_REREAD_S)
            try:
                with self.conn.sftp().open(path, "rb") as handle:
                    stat = handle.read().decode(errors="replace")
                return stat_state(stat) if stat.strip() else None
            except (FileNotFoundError, ProcessLookupError):  # gone (before or while it was read)
                return None
            except paramiko.SSHException as exc:
                raise self.fail(f"could not read {path} over SFTP ({_reason(exc)})") from None
            except (OSError, EOFError) as exc:
                # SFTP's generic "Failure": the node's sftp-server maps every errno but ENOENT and
                # EACCES to it, and a process being reaped as its stat is read gives ESRCH. Read
                # again: a process that is gone is then not found.
                error = exc
        raise self.fail(f"could not read {path} over SFTP ({_reason(error)})") from None

    def stop(self, pids: Sequence[int], grace_s: float) -> dict[int, str]:
        """SIGTERM each process group, SIGKILL after ``grace_s``: how each ended."""
        if not pids:
            return {}
        out = self.python(f"-m tiderl.launch.nodectl stop --grace {grace_s:g} "
                          f"{' '.join(map(str, pids))}", timeout_s=grace_s + COMMAND_TIMEOUT_S)
        return {int(k): v for k, v in json.loads(out.strip().splitlines()[-1]).items()}

    def read(self, path: str, offset: int = 0) -> bytes | None:
        """The bytes of ``path`` from ``offset`` on (None if it does not exist)."""
        try:
            with self.conn.sftp().open(path, "rb") as handle:
                handle.seek(offset)
                return handle.read()
        except FileNotFoundError:
            return None
        except (OSError, paramiko.SSHException) as exc:
            raise self.fail(f"could not read {path} over SFTP ({_reason(exc)})") from None

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(self.conn.sftp().listdir(path))
        except FileNotFoundError:
            return []

    def fetch(self, remote: str, local: Path) -> bool:
        """Copy ``remote`` to ``local``; False when it does not exist."""
        data = self.read(remote)
        if data is None:
            return False
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(data)
        return True

    def fetch_tree(self, remote: str, local: Path) -> int:
        """Copy the folder ``remote`` (its regular files, and its folders' at any depth; not
        symbolic links) into ``local``; returns the files copied (0 when it does not exist)."""
        try:
            entries = self.conn.sftp().listdir_attr(remote)
        except FileNotFoundError:
            return 0
        except (OSError, paramiko.SSHException) as exc:
            raise self.fail(f"could not list {remote} over SFTP ({_reason(exc)})") from None
        copied = 0
        for entry in sorted(entries, key=lambda e: e.filename):
            path = f"{remote}/{entry.filename}"
            if stat.S_ISDIR(entry.st_mode or 0):
                copied += self.fetch_tree(path, local / entry.filename)
            elif stat.S_ISREG(entry.st_mode or 0):
                copied += self.fetch(path, local / entry.filename)
        return copied


def _make_dirs(sftp: paramiko.SFTPClient, folder: str) -> None:
    """``mkdir -p folder`` over SFTP."""
    missing = []
    while folder not in ("", "/"):
        try:
            sftp.stat(folder)
            break
        except FileNotFoundError:
            missing.append(folder)
            folder = posixpath.dirname(folder)
    for path in reversed(missing):
        sftp.mkdir(path)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, socket.timeout | TimeoutError):
        return "timed out"
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return " ".join(text.split())[:160]


def _is_ip(address: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in address else socket.AF_INET, address)
    except OSError:
        return False
    return True


def open_sessions(nodes: Sequence[Node]) -> dict[str, NodeSession]:
    """An open session to each node; on any failure the open ones are closed and the error
    (naming its node) raised."""
    sessions: dict[str, NodeSession] = {}
    try:
        for node in nodes:
            sessions[node.name] = NodeSession(node).open()
    except NodeError:
        for session in sessions.values():
            session.close()
        raise
    return sessions


def job_node(info: dict, node_name: str) -> Node:
    """A node of a launched job, from job.json's ``info["nodes"]``."""
    return Node(**{**info["nodes"][node_name], "devices": (0,)})


def session_for(info: dict, node_name: str) -> NodeSession:
    """A session (not open yet) to a node of a launched job."""
    return NodeSession(job_node(info, node_name))

