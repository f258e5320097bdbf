"""A throwaway OpenSSH server on 127.0.0.1 (temp host key, temp authorized key), started and stopped by PID.

Lets SshTransport, and `gpufleet status`/`verify` through pyinfra's connector, be tested with a real sshd and real
paramiko channels, without test hosts. Only `user` may log in (any local account: its key is read by root).
"""

from __future__ import annotations

import getpass
import shutil
import socket
import subprocess
import time
from pathlib import Path

import paramiko

from tests.ports import free_port

SSHD = Path("/usr/sbin/sshd")


class Sshd:
    def __init__(self, workdir: Path, user: str | None = None):
        self.dir = workdir
        self.port = free_port()
        self.user = user or getpass.getuser()
        self.client_key = workdir / "client_key"
        self.proc: subprocess.Popen | None = None

    @staticmethod
    def available() -> str | None:
        """None when a throwaway sshd can run here, else why not."""
        if not SSHD.exists():
            return f"{SSHD} missing (apt-get install -y openssh-server)"
        if not shutil.which("ssh-keygen"):
            return "ssh-keygen missing"
        return None

    def start(self) -> Sshd:
        d = self.dir
        for key in ("host_key", "client_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True)
        (d / "authorized_keys").write_text((d / "client_key.pub").read_text())
        (d / "authorized_keys").chmod(0o600)
        config = d / "sshd_config"
        config.write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {d / 'host_key'}\nPidFile {d / 'sshd.pid'}\n"
            # sshd reads an AuthorizedKeysFile as the user, who may not reach the test's temp dir; cat runs as root.
            f"AuthorizedKeysFile none\nAuthorizedKeysCommand /bin/cat {d / 'authorized_keys'}\n"
            f"AuthorizedKeysCommandUser root\nAllowUsers {self.user}\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nPubkeyAuthentication yes\nPermitRootLogin prohibit-password\n"
            # StrictModes off: the temp dir's ownership/modes are the test's, not a home directory's.
            "UsePAM no\nStrictModes no\nAllowTcpForwarding yes\nLogLevel ERROR\n"
            # A fleet check may point many hosts at this one server: sshd's default drops unauthenticated
            # connections beyond 10 at once.
            "MaxStartups 100\n"
        )
        # sshd refuses to start without its privilege separation directory (normally made by the service unit).
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        self.proc = subprocess.Popen(
            [str(SSHD), "-D", "-e", "-f", str(config)], stdout=subprocess.DEVNULL, stderr=(d / "sshd.log").open("wb")
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"sshd did not start: {(d / 'sshd.log').read_text()[-500:]}")

    @property
    def host_key(self) -> paramiko.PKey:
        return paramiko.Ed25519Key.from_private_key_file(str(self.dir / "host_key"))

    def known_hosts_line(self) -> str:
        """This server's entry for a known_hosts file (OpenSSH's [host]:port form for a port other than 22)."""
        return f"[127.0.0.1]:{self.port} {self.host_key.get_name()} {self.host_key.get_base64()}\n"

    def client(self) -> paramiko.SSHClient:
        client = paramiko.SSHClient()
        # Pin the throwaway host key: the test must not trust whatever answers on the port.
        client.get_host_keys().add(f"[127.0.0.1]:{self.port}", self.host_key.get_name(), self.host_key)
        client.connect(
            "127.0.0.1", port=self.port, username=self.user, key_filename=str(self.client_key),
            look_for_keys=False, allow_agent=False, timeout=10,
        )  # fmt: skip
        return client

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
