"""A real Slurm on loopback for the ``--slurm`` launch tests: munged with a key of its own,
slurmctld and two slurmd (node names n1 and n2, both this machine, each on its own port), all
with their own config, state and sockets under the test's tmp folder; ``SLURM_CONF`` points
the client commands (salloc, srun, squeue, scancel, scontrol) at it.

Every daemon runs as the current user (``SlurmUser`` and ``SlurmdUser``; munged with
``--force``, without which it refuses root), so the jobs run as that user too. Without the Debian
packages (slurmctld, slurmd, munge, slurm-client) the tests skip, except under CI (``CI`` set),
where they fail: ``.ci/run`` installs them.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.serving import free_port

NODES = ("n1", "n2")
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("salloc", "srun", "squeue", "scancel", "scontrol", "sinfo")
SHARED = "OverSubscribe=FORCE"  # jobs share the nodes' CPUs (the tests' jobs are small)
UP_S = 60.0  # the daemons registered and the nodes idle (they start in seconds)


def require_slurm() -> None:
    missing = [d for d in DAEMONS if shutil.which(d, path="/usr/sbin:/usr/bin") is None]
    missing += [c for c in CLIENTS if shutil.which(c) is None]
    why = (f"{', '.join(missing)} not installed (apt-get install slurmctld slurmd munge "
           "slurm-client)" if missing else "")
    if not why:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI must run the Slurm tests: {why}")
    pytest.skip(why)


def _config(folder: Path, ports: dict[str, int]) -> str:
    nodes = "\n".join(
        f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={ports[name]} "
        f"CPUs={os.cpu_count() or 1} State=UNKNOWN" for name in NODES)
    user = getpass.getuser()
    return f"""ClusterName=tiderltest
SlurmctldHost=localhost
SlurmctldPort={ports['ctld']}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={folder}/munge.sock
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool-%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
{nodes}
PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP {SHARED}
"""


def _wait_idle(env: dict[str, str], daemons: list[subprocess.Popen], folder: Path) -> None:
    deadline = time.monotonic() + UP_S
    while time.monotonic() < deadline:
        for proc in daemons:  # -D: a daemon that exits failed
            if proc.poll() is not None:
                logs = {p.name: p.read_text()[-800:] for p in folder.glob("*.log")}
                raise AssertionError(f"{proc.args[0]} exited {proc.returncode}: {logs}")
        out = subprocess.run(["sinfo", "-h", "-o", "%t %D"], env=env, capture_output=True,
                             text=True).stdout.split()
        if out[:2] == ["idle", str(len(NODES))]:
            return
        time.sleep(0.2)
    raise AssertionError(f"the Slurm nodes were not idle within {UP_S:.0f} s")


@contextlib.contextmanager
def slurm_cluster(folder: Path) -> Iterator[dict[str, str]]:
    """A two-node Slurm; yields the environment its client commands need."""
    require_slurm()
    (folder / "state").mkdir(parents=True)
    key = folder / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    ports = {"ctld": free_port(), **{name: free_port() for name in NODES}}
    conf = folder / "slurm.conf"
    conf.write_text(_config(folder, ports))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    started: list[subprocess.Popen] = []
    try:
        munged = subprocess.Popen(
            ["munged", "--foreground", "--force", f"--key-file={key}",
             f"--socket={folder}/munge.sock", f"--pid-file={folder}/munged.pid",
             f"--log-file={folder}/munged.log", f"--seed-file={folder}/munge.seed"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        started.append(munged)
        deadline = time.monotonic() + UP_S
        while not (folder / "munge.sock").exists():
            assert munged.poll() is None, (folder / "munged.log").read_text()[-800:]
            assert time.monotonic() < deadline, "munged did not open its socket"
            time.sleep(0.05)
        started.append(subprocess.Popen(["slurmctld", "-D", "-c", "-f", str(conf)], env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for name in NODES:
            started.append(subprocess.Popen(["slurmd", "-D", "-N", name, "-f", str(conf)],
                                            env=env, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL))
        _wait_idle(env, started, folder)
        yield env
    finally:
        for proc in reversed(started):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
