"""TLS for the trainer's gRPC server without a certificate authority: pinned self-signed certificates.

A trainer with `tls = true` keeps a self-signed certificate (EC P-256, 10 years) in
`state_dir/tls/`, made on first start, so its fingerprint survives restarts. The sha256 of the
certificate's DER bytes goes into the trainer's signed DHT job record (`tls_cert_sha256`). A
worker that reads the record fetches the certificate the endpoint presents, checks its sha256
against the signed fingerprint, and then trusts exactly that certificate as the channel's only
root: any other certificate fails the handshake. No CA, no trust on first use: the trust comes
from the trainer's Ed25519 signature over the record. Messages stay signed either way; an empty
fingerprint means a plaintext endpoint (loopback, or an operator's choice).
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

SERVER_NAME = "swarmrl-trainer"
"""The DNS name every trainer certificate carries; clients verify against it (the address may be
anything: the pin, not the name, says whose certificate it is)."""
FETCH_TIMEOUT_S = 10.0


class PinError(ConnectionError):
    """The endpoint could not be reached to read its certificate, or it presented a certificate
    whose sha256 is not the one the trainer's signed record pins."""


@dataclass(frozen=True)
class ServerCert:
    """A trainer's certificate and key (PEM) and the certificate's sha256 (DER bytes)."""

    cert_pem: bytes
    key_pem: bytes

    @property
    def sha256(self) -> bytes:
        """The fingerprint that goes into the signed job record."""
        return fingerprint(self.cert_pem)

    def credentials(self) -> grpc.ServerCredentials:
        """gRPC server credentials presenting this certificate."""
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)])


def fingerprint(cert_pem: bytes) -> bytes:
    """sha256 of a PEM certificate's DER bytes."""
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(cert_pem.decode())).digest()


def load_or_create(folder: Path, hosts: Sequence[str] = ()) -> ServerCert:
    """The certificate in `folder` (cert.pem, key.pem), made self-signed on first use with
    SERVER_NAME and `hosts` (IP addresses or names) as subject alternative names."""
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    if cert_path.exists() and key_path.exists():
        return ServerCert(cert_path.read_bytes(), key_path.read_bytes())
    folder.mkdir(parents=True, exist_ok=True)
    made = make_self_signed(hosts)
    fd = os.open(key_path.with_suffix(".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(made.key_pem)
    os.replace(key_path.with_suffix(".tmp"), key_path)
    cert_path.write_bytes(made.cert_pem)
    return made


def make_self_signed(hosts: Sequence[str] = ()) -> ServerCert:
    """A fresh EC P-256 key and a self-signed certificate for SERVER_NAME and `hosts`."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, SERVER_NAME)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=3650))
            .add_extension(x509.SubjectAlternativeName(_alt_names(hosts)), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return ServerCert(cert.public_bytes(serialization.Encoding.PEM), key_pem)


def _alt_names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [x509.DNSName(SERVER_NAME)]
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return names


def presented_cert(endpoint: str, timeout_s: float = FETCH_TIMEOUT_S) -> bytes:
    """The PEM certificate the TLS server at HOST:PORT presents (not verified: pin it).

    Raises:
        PinError: the endpoint could not be reached or spoke no TLS.
    """
    host, _, port = endpoint.rpartition(":")
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as raw, \
                ctx.wrap_socket(raw, server_hostname=SERVER_NAME) as tls:
            der = tls.getpeercert(binary_form=True)
    except (OSError, ValueError) as exc:
        raise PinError(f"could not read the TLS certificate of {endpoint}: {exc}") from exc
    if not der:
        raise PinError(f"{endpoint} presented no certificate")
    return ssl.DER_cert_to_PEM_cert(der).encode()


def pinned_credentials(endpoint: str, cert_sha256: bytes) -> grpc.ChannelCredentials:
    """Channel credentials that trust only the certificate `endpoint` presents, once its sha256
    equals `cert_sha256` (from the trainer's signed record).

    Raises:
        PinError: unreachable, or a certificate that is not the pinned one.
    """
    pem = presented_cert(endpoint)
    got = fingerprint(pem)
    if got != cert_sha256:
        raise PinError(f"{endpoint} presented certificate sha256 {got.hex()[:16]}…, "
                       f"but the trainer's signed record pins {cert_sha256.hex()[:16]}…")
    return grpc.ssl_channel_credentials(root_certificates=pem)


def channel(endpoint: str, cert_sha256: bytes, options: Sequence[tuple[str, int | str]]) -> grpc.Channel:
    """A channel to a trainer: TLS pinned to `cert_sha256`, or plaintext when it is empty.

    Raises:
        PinError: TLS was asked for and the pinned certificate could not be confirmed.
    """
    if not cert_sha256:
        return grpc.insecure_channel(endpoint, options=options)
    creds = pinned_credentials(endpoint, cert_sha256)
    return grpc.secure_channel(endpoint, creds, options=[*options, ("grpc.ssl_target_name_override", SERVER_NAME)])
