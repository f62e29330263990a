"""An emulated cluster of hosts for launcher tests: network namespaces on a bridge, each running sshd.

Host ``i`` is network namespace ``<prefix>h<i>`` with ``eth0 = 10.231.0.<i+1>/24``,
a veth whose other end is a port of bridge ``br0`` in namespace ``<prefix>sw``
(the layout of ``bench/netns_cluster.sh``, without its rate limits, and with
names unique to this process so that it never touches another run's cluster).
Nothing is added to the root namespace.

Every host runs its own ``sshd`` (Debian's openssh-server) on port 22 with a
host key, a client key and a config made here in a temporary folder; root may
log in with that key only. The namespaces share this machine's filesystem,
PID namespace and Python, so the same paths work on every host, and a host's
process table is the set of processes in its network namespace (``ip netns
pids``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

NET = "10.231.0"
SBIN_PATH = "/usr/sbin:/usr/local/sbin:/sbin:" + os.environ.get("PATH", "")
SSHD_CONFIG = """\
Port 22
HostKey {dir}/host_key
AuthorizedKeysFile {dir}/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
UseDNS no
PidFile none
LogLevel ERROR
"""


def unavailable() -> str | None:
    """Why this machine cannot run the cluster (a skip reason), or ``None`` when it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and sshd)"
    for tool, package in (("ip", "iproute2"), ("ssh", "openssh-client"), ("ssh-keygen", "openssh-client")):
        if shutil.which(tool, path=SBIN_PATH) is None:
            return f"{tool} not installed (apt-get install {package})"
    if shutil.which("sshd", path=SBIN_PATH) is None:
        return "sshd not installed (apt-get install openssh-server)"
    probe = f"rcprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        return f"ip netns unavailable: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


class SshCluster:
    """``size`` hosts, each with sshd running (see the module docstring); use :func:`ssh_cluster`."""

    def __init__(self, size: int, workdir: Path) -> None:
        self.size = size
        self.workdir = workdir
        self.prefix = f"rct{os.getpid()}"
        self.switch = f"{self.prefix}sw"
        self.namespaces = [f"{self.prefix}h{i}" for i in range(size)]
        self.addresses = [f"{NET}.{i + 1}" for i in range(size)]
        self.key = workdir / "id_ed25519"
        self.known_hosts = workdir / "known_hosts"
        self.sshd: list[subprocess.Popen[bytes]] = []

    def ssh_options(self) -> list[str]:
        """``ringcore-run`` options that reach these hosts, without touching ``~/.ssh``."""
        extra = f"-F /dev/null -o UserKnownHostsFile={self.known_hosts} -o GlobalKnownHostsFile=/dev/null"
        return ["--ssh-identity-file", str(self.key), "--ssh-args", extra]

    def on(self, host: int, *argv: str) -> list[str]:
        """``argv`` run on ``host``."""
        return ["ip", "netns", "exec", self.namespaces[host], *argv]

    def pids(self, host: int) -> set[int]:
        """Every process on ``host`` (in its network namespace)."""
        out = subprocess.run(["ip", "netns", "pids", self.namespaces[host]], capture_output=True, text=True)
        return {int(word) for word in out.stdout.split()}

    def strays(self, host: int) -> set[int]:
        """Processes on ``host`` other than its sshd listener."""
        return self.pids(host) - {self.sshd[host].pid}

    def kill_strays(self) -> None:
        """SIGKILL everything on every host but its sshd: what a failed test left must not fail the next."""
        for host in range(self.size):
            for pid in self.strays(host):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def start(self) -> None:
        """Build the namespaces and the bridge, make the keys, start every sshd and wait for it."""
        self._network()
        self._keys()
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
        sshd = shutil.which("sshd", path=SBIN_PATH)
        config = self.workdir / "sshd_config"
        config.write_text(SSHD_CONFIG.format(dir=self.workdir))
        for host, address in enumerate(self.addresses):
            log = (self.workdir / f"sshd{host}.log").open("wb")
            argv = self.on(host, str(sshd), "-D", "-e", "-f", str(config), "-o", f"ListenAddress={address}")
            self.sshd.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log))
            log.close()
        for address in self.addresses:
            self._wait_for_port(address, 22)

    def _network(self) -> None:
        run = _ip
        run("netns", "add", self.switch)
        run("-n", self.switch, "link", "set", "lo", "up")
        run("-n", self.switch, "link", "add", "br0", "type", "bridge", "stp_state", "0", "forward_delay", "0")
        run("-n", self.switch, "link", "set", "br0", "up")
        for host, (ns, address) in enumerate(zip(self.namespaces, self.addresses, strict=True)):
            run("netns", "add", ns)
            run("-n", ns, "link", "set", "lo", "up")
            run(
                "-n",
                ns,
                "link",
                "add",
                "eth0",
                "type",
                "veth",
                "peer",
                "name",
                f"sw{host}",
                "netns",
                self.switch,
            )
            run("-n", self.switch, "link", "set", f"sw{host}", "master", "br0", "up")
            run("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            run("-n", ns, "link", "set", "eth0", "up")

    def _keys(self) -> None:
        for name in ("host_key", self.key.name):
            subprocess.run(
                [
                    "ssh-keygen",
                    "-q",
                    "-t",
                    "ed25519",
                    "-N",
                    "",
                    "-C",
                    "ringcore-test",
                    "-f",
                    str(self.workdir / name),
                ],
                check=True,
                capture_output=True,
            )
        shutil.copy(self.key.with_suffix(".pub"), self.workdir / "authorized_keys")

    def _wait_for_port(self, address: str, port: int, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        probe = self.on(0, "bash", "-c", f"exec 3<>/dev/tcp/{address}/{port}")
        while subprocess.run(probe, capture_output=True, check=False).returncode != 0:
            if time.monotonic() > deadline:
                logs = "\n".join(p.read_text() for p in self.workdir.glob("sshd*.log"))
                raise RuntimeError(f"sshd on {address} did not start within {timeout:g} s:\n{logs}")
            time.sleep(0.1)

    def close(self) -> None:
        """Kill everything still running on the hosts (this cluster's only), then delete the namespaces."""
        for proc in self.sshd:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        for host in range(len(self.namespaces)):
            for pid in self.pids(host) if self._exists(host) else ():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for proc in self.sshd:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        for ns in [*self.namespaces, self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)

    def _exists(self, host: int) -> bool:
        return Path("/run/netns", self.namespaces[host]).exists()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def ssh_cluster(size: int) -> Iterator[SshCluster]:
    """A running :class:`SshCluster` of ``size`` hosts, torn down (namespaces, sshd, keys) even on failure."""
    with tempfile.TemporaryDirectory(prefix="ringcore-hosts-") as tmp:
        os.chmod(tmp, 0o700)
        cluster = SshCluster(size, Path(tmp))
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.close()
