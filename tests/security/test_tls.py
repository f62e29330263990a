"""TLS for the rendezvous store: a job with RINGCORE_TLS_CERT/KEY/CA works, strangers without it do not.

Certificates come from the ``openssl`` CLI, made fresh in a temporary
directory: a CA, one rank certificate it signed (every rank presents the
same one), and a rogue self-signed certificate. With ``RINGCORE_TLS_CA`` the
store requires client certificates signed by that CA, and inside TLS the
HMAC handshake still runs. Everything stays on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ringcore import auth
from ringcore.errors import AuthenticationError, ConfigError
from ringcore.store import StoreClient, StoreServer, tls_contexts
from tests import tasks
from tests.cluster import Cluster
from tests.security import BOUND, recv_all

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make certificates"),
]

SECRET = "tls-secret-77e2"
LEAF_EXTENSIONS = """\
basicConstraints = CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth, clientAuth
subjectAltName = IP:127.0.0.1
"""


def openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"openssl {' '.join(args)} failed:\n{done.stderr}"


def self_signed(directory: Path, name: str) -> None:
    openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        cwd=directory,
    )  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Paths of ``ca``, ``cert``/``key`` (signed by ``ca``) and ``rogue_cert``/``rogue_key``."""
    directory = tmp_path_factory.mktemp("tls")
    self_signed(directory, "ca")
    self_signed(directory, "rogue")
    (directory / "leaf.ext").write_text(LEAF_EXTENSIONS)
    openssl(
        "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", "rank.key", "-out", "rank.csr", "-subj", "/CN=127.0.0.1",
        cwd=directory,
    )  # fmt: skip
    openssl(
        "x509", "-req", "-in", "rank.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-set_serial", "2",
        "-days", "2", "-extfile", "leaf.ext", "-out", "rank.pem",
        cwd=directory,
    )  # fmt: skip
    return {
        "ca": str(directory / "ca.pem"),
        "cert": str(directory / "rank.pem"),
        "key": str(directory / "rank.key"),
        "rogue_cert": str(directory / "rogue.pem"),
        "rogue_key": str(directory / "rogue.key"),
    }


@pytest.fixture(scope="module")
def tls_job(certs: dict[str, str]) -> Iterator[tuple[Cluster, int]]:
    env = {
        "RINGCORE_SECRET": SECRET,
        "RINGCORE_HANDSHAKE_TIMEOUT": "2",
        "RINGCORE_TLS_CERT": certs["cert"],
        "RINGCORE_TLS_KEY": certs["key"],
        "RINGCORE_TLS_CA": certs["ca"],
    }
    with Cluster(2, env=env) as cluster:
        yield cluster, cluster.results(tasks.store_address)[0][1]


def test_job_over_tls_reduces_correctly(tls_job: tuple[Cluster, int]) -> None:
    cluster, _ = tls_job
    inputs = [np.linspace(0, 1, 5000, dtype=np.float64) * (r + 2) for r in range(2)]
    for out in cluster.results(tasks.allreduce, inputs, "sum"):
        np.testing.assert_allclose(out, inputs[0] + inputs[1], rtol=0, atol=1e-12)


def test_tls_client_with_the_secret_is_served(tls_job: tuple[Cluster, int], certs: dict[str, str]) -> None:
    """The control for the rejections below: the same path with everything right works."""
    _, port = tls_job
    _, client_tls = tls_contexts(certs["cert"], certs["key"], certs["ca"])
    client = StoreClient("127.0.0.1", port, BOUND, SECRET.encode(), BOUND, client_tls)
    try:
        assert isinstance(client.mget(["session"])[0], int)
    finally:
        client.close()


def test_plain_tcp_client_is_rejected(tls_job: tuple[Cluster, int]) -> None:
    _, port = tls_job
    with socket.create_connection(("127.0.0.1", port), timeout=BOUND) as sock:
        with pytest.raises((AuthenticationError, ConnectionError)):  # an alert, or a reset
            auth.client_handshake(sock, SECRET.encode(), auth.STORE_CONTEXT, BOUND)
        with contextlib.suppress(OSError):
            sock.sendall(b"\x10\x00\x00\x00" + b"\x92\xa3get\xa7session")
        reply = recv_all(sock)
        assert auth.MAGIC not in reply and b"session" not in reply
    with pytest.raises(AuthenticationError, match="RINGCORE_SECRET"):
        StoreClient("127.0.0.1", port, BOUND, SECRET.encode(), BOUND, tls=None)
    test_job_over_tls_reduces_correctly(tls_job)


def rejected_tls(port: int, context: ssl.SSLContext, key: bytes) -> BaseException:
    """What a TLS client with ``context`` and HMAC ``key`` gets from the store."""
    try:
        StoreClient("127.0.0.1", port, BOUND, key, BOUND, context).close()
    except AuthenticationError as err:
        return err
    pytest.fail("the store admitted the client")


def test_tls_client_without_a_certificate_is_rejected(
    tls_job: tuple[Cluster, int], certs: dict[str, str]
) -> None:
    _, port = tls_job
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.load_verify_locations(certs["ca"])
    assert "failed" in str(rejected_tls(port, context, SECRET.encode()))


def test_tls_client_with_a_rogue_certificate_is_rejected(
    tls_job: tuple[Cluster, int], certs: dict[str, str]
) -> None:
    _, port = tls_job
    _, context = tls_contexts(certs["rogue_cert"], certs["rogue_key"], certs["ca"])
    rejected_tls(port, context, SECRET.encode())


def test_tls_client_with_the_wrong_secret_is_rejected(
    tls_job: tuple[Cluster, int], certs: dict[str, str]
) -> None:
    """TLS does not replace the HMAC handshake: a valid certificate without the secret gets nothing."""
    _, port = tls_job
    _, context = tls_contexts(certs["cert"], certs["key"], certs["ca"])
    assert "does not share" in str(rejected_tls(port, context, b"guessed"))
    test_job_over_tls_reduces_correctly(tls_job)


def test_client_refuses_a_store_with_a_rogue_certificate(certs: dict[str, str]) -> None:
    """A rank does not talk to an impostor store whose certificate the CA did not sign."""

    rogue_server, _ = tls_contexts(certs["rogue_cert"], certs["rogue_key"], None)
    server = StoreServer("127.0.0.1", 0, SECRET.encode(), BOUND, rogue_server)
    try:
        _, context = tls_contexts(certs["cert"], certs["key"], certs["ca"])
        rejected_tls(server.port, context, SECRET.encode())
    finally:
        server.close()


def test_tls_key_without_cert_is_a_config_error(certs: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="RINGCORE_TLS_CERT"):
        tls_contexts(None, certs["key"], certs["ca"])
    with pytest.raises(ConfigError, match="cannot load"):
        tls_contexts(certs["cert"], certs["rogue_key"], certs["ca"])
