"""TLS without a CA (node/net/tls.py): a trainer's self-signed certificate, pinned by the sha256 its
signed record carries. Servers bind 127.0.0.1 only."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped]

from swarmrl.node.net import tls
from swarmrl.node.net.grpc_options import channel_options
from swarmrl.node.net.grpc_standard import add_standard_services


def _serve(credentials: grpc.ServerCredentials | None) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    add_standard_services(server, ["swarmrl.v1.Trainer"])
    port = (server.add_insecure_port("127.0.0.1:0") if credentials is None
            else server.add_secure_port("127.0.0.1:0", credentials))
    server.start()
    return server, f"127.0.0.1:{port}"


def _healthy(channel: grpc.Channel) -> bool:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


@pytest.fixture
def cert(tmp_path: Path) -> tls.ServerCert:
    return tls.load_or_create(tmp_path / "tls", ["127.0.0.1"])


@pytest.fixture
def tls_server(cert: tls.ServerCert) -> Iterator[str]:
    server, endpoint = _serve(cert.credentials())
    yield endpoint
    server.stop(None)


def test_certificate_is_kept_and_its_key_private(tmp_path: Path, cert: tls.ServerCert) -> None:
    again = tls.load_or_create(tmp_path / "tls", ["127.0.0.1"])
    assert again.sha256 == cert.sha256 and len(cert.sha256) == 32
    assert stat.S_IMODE((tmp_path / "tls" / "key.pem").stat().st_mode) == 0o600


def test_pinned_channel_talks_to_the_pinned_server(tls_server: str, cert: tls.ServerCert) -> None:
    assert tls.fingerprint(tls.presented_cert(tls_server)) == cert.sha256
    with tls.channel(tls_server, cert.sha256, channel_options(4)) as ch:
        assert _healthy(ch)


def test_another_certificate_is_refused(tls_server: str) -> None:
    """A server whose certificate is not the pinned one (an impostor at the announced address)."""
    other = tls.make_self_signed(["127.0.0.1"])
    with pytest.raises(tls.PinError, match="pins"):
        tls.channel(tls_server, other.sha256, channel_options(4))


def test_a_swapped_certificate_fails_the_handshake(cert: tls.ServerCert) -> None:
    """Pinned once, the channel trusts exactly that certificate: a server that later presents
    another (same name, same address) fails the gRPC handshake."""
    server, endpoint = _serve(cert.credentials())
    ch = tls.channel(endpoint, cert.sha256, channel_options(4))
    port = endpoint.rpartition(":")[2]
    server.stop(None).wait()
    impostor = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    add_standard_services(impostor, ["swarmrl.v1.Trainer"])
    impostor.add_secure_port(f"127.0.0.1:{port}", tls.make_self_signed(["127.0.0.1"]).credentials())
    impostor.start()
    try:
        with pytest.raises(grpc.RpcError) as err:
            _healthy(ch)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        ch.close()
        impostor.stop(None)


def test_plaintext_stays_available_and_is_not_tls() -> None:
    server, endpoint = _serve(None)
    try:
        with tls.channel(endpoint, b"", channel_options(4)) as ch:
            assert _healthy(ch)
        with pytest.raises(tls.PinError):   # a pin against a plaintext server: no certificate to check
            tls.channel(endpoint, b"\0" * 32, channel_options(4))
    finally:
        server.stop(None)


def test_unreachable_endpoint_is_a_pin_error() -> None:
    with pytest.raises(tls.PinError, match="could not read"):
        tls.presented_cert("127.0.0.1:1", timeout_s=2)


def test_trainer_server_over_tls_and_the_tools_pin(cert: tls.ServerCert, capsys: pytest.CaptureFixture[str]) -> None:
    """The trainer's own server (`serve(credentials=...)`) and the submitter's tools against it:
    the pinned certificate works, another pin or none fails with one line and exit code 1."""
    from types import SimpleNamespace

    from swarmrl.node.cli import main as cli
    from swarmrl.node.submitter.client import job_status
    from swarmrl.node.trainer.service import serve

    server, port = serve(SimpleNamespace(jobs={}), "127.0.0.1", 0, 4, credentials=cert.credentials())  # type: ignore[arg-type]
    endpoint = f"127.0.0.1:{port}"
    try:
        assert job_status(endpoint, "nojob", tls_sha256=cert.sha256).state == "unknown"
        assert cli.main(["status", "nojob", "--trainer", endpoint, "--tls-sha256", cert.sha256.hex()]) == 1
        assert "unknown job" in capsys.readouterr().err
        other = tls.make_self_signed().sha256.hex()
        assert cli.main(["status", "nojob", "--trainer", endpoint, "--tls-sha256", other]) == 1
        assert "pins" in capsys.readouterr().err
    finally:
        server.stop(None)
