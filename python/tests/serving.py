"""Real ``kvsp serve`` processes for the tests: ports, configurations,
certificates (``kvsp certs``), start, wait until listening, stop or
SIGKILL."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from kvsp.client import Client

ROOT = pathlib.Path(__file__).resolve().parents[2]
SERVER_ID = "spiffe://kvsp.local/node/127.0.0.1"


def binary(nogpu: bool = False) -> pathlib.Path:
    """bin/kvsp, or with nogpu the build whose device is the stand-in in
    host memory (go build -tags nogpu): its device tier takes memfd pools."""
    var, name = ("KVSP_NOGPU_BIN", "kvsp-nogpu") if nogpu else ("KVSP_BIN", "kvsp")
    b = pathlib.Path(os.environ.get(var, ROOT / "bin" / name)).resolve()
    if not b.exists():
        pytest.fail(f"{b} is missing: make test-python builds it")
    return b


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (all bound at once, so none repeats)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def certs(config: pathlib.Path, *extra: str) -> None:
    """The CA, the certificates and the policy a configuration names."""
    subprocess.run([str(binary()), "certs", "--config", str(config), *extra], check=True, capture_output=True)


@dataclass
class Proc:
    """A ``kvsp serve`` process and its log."""

    config: pathlib.Path
    port: int
    env: dict[str, str] = field(default_factory=dict)
    nogpu: bool = False
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        log = open(self.config.with_suffix(".log"), "ab")  # noqa: SIM115 (the child holds it)
        with log:
            self.popen = subprocess.Popen(
                [str(binary(self.nogpu)), "serve", "--config", str(self.config)],
                cwd=self.config.parent,
                stdout=log,
                stderr=log,
                env={**os.environ, **self.env},
            )
        end = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                if self.popen.poll() is not None or time.monotonic() > end:
                    raise RuntimeError(f"kvsp serve did not start: {self.log()[-2000:]}") from None
                time.sleep(0.05)

    def log(self) -> str:
        return self.config.with_suffix(".log").read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL: nothing flushed, nothing withdrawn."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(timeout=30)

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class Served:
    """A running deployment: its directory (certificates, scope keys) and
    the base URI of its first process."""

    dir: pathlib.Path
    base: str

    def client(self, who: str = "client", identity: str | None = SERVER_ID) -> Client:
        d = self.dir
        return Client(
            cert=str(d / f"{who}.pem"), key=str(d / f"{who}.key"), ca=str(d / "ca.pem"), server_identity=identity
        )


def start_split(
    d: pathlib.Path, port: int, common: str, roles: str, inst: Callable[[str], str], insts: list[str], head: str = ""
) -> tuple[list[Proc], dict[str, Proc]]:
    """A deployment of one process for the shared roles (listening on
    port, with head's extra lines) and one per instance (by base URI):
    the union configuration makes the one identity they share (they are
    all on 127.0.0.1) and its policy. Returns every process, the shared
    one first, and the instances' by base URI."""
    (d / "all.yaml").write_text(
        f"listen: 127.0.0.1:{port}\n" + common + roles + "instances:\n" + "".join(map(inst, insts))
    )
    certs(d / "all.yaml")
    (d / "a.yaml").write_text(f"listen: 127.0.0.1:{port}\n" + head + common + roles)
    procs = [Proc(d / "a.yaml", port).start()]
    by_uri: dict[str, Proc] = {}
    for i, b in enumerate(insts):
        p = int(b.split(":")[2].split("/")[0])
        (d / f"b{i + 1}.yaml").write_text(f"listen: 127.0.0.1:{p}\n" + common + "instances:\n" + inst(b))
        by_uri[b] = Proc(d / f"b{i + 1}.yaml", p).start()
        procs.append(by_uri[b])
    return procs, by_uri
