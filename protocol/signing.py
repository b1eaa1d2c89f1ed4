"""Signed envelopes: Ed25519 over a domain tag and the exact serialized body.

The signer serializes the inner protobuf message once (deterministically) into `Signed.body` and
signs ``b"swarmrl.v1/" + domain + b"\\x00" + body``. A receiver verifies the bytes it received
before parsing them, so no canonical re-encoding is ever needed, and the domain tag keeps a
signature for one message kind from being replayed as another.
"""

from __future__ import annotations

import hashlib
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from swarmrl.protocol.identity import Identity, peer_id_from_public_key, verify_raw
from swarmrl.protocol.pb import swarm_pb2 as pb

# One domain per signed message kind.
JOB = "job"
JOB_RECORD = "job-record"
LEASE_REQUEST = "lease-request"
ROLLOUT_BATCH = "rollout-batch"
ADAPTER_UPDATE = "adapter-update"
VERDICTS = "verdicts"
DELTA_HOLDER = "delta-holder"
WORKER_ENVS = "worker-envs"
BATCH_RECEIPT = "batch-receipt"
CONTRIBUTION = "contribution"
AUDIT_REPORT = "audit-report"
STATEMENT_HOLDER = "statement-holder"
AVERAGING_TICKET = "averaging-ticket"
DOMAINS = frozenset({JOB, JOB_RECORD, LEASE_REQUEST, ROLLOUT_BATCH, ADAPTER_UPDATE, VERDICTS, DELTA_HOLDER,
                     WORKER_ENVS, BATCH_RECEIPT, CONTRIBUTION, AUDIT_REPORT, STATEMENT_HOLDER, AVERAGING_TICKET})

M = TypeVar("M", bound=Message)


class SignatureError(ValueError):
    """A signed envelope failed verification or could not be parsed."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def _tagged(domain: str, body: bytes) -> bytes:
    if domain not in DOMAINS:
        raise ValueError(f"unknown signing domain {domain!r}")
    return b"swarmrl.v1/" + domain.encode() + b"\x00" + body


def canonical_bytes(message: Message) -> bytes:
    """Deterministic protobuf serialization of `message` (what gets signed)."""
    return message.SerializeToString(deterministic=True)


def sign(identity: Identity, domain: str, message: Message) -> pb.Signed:
    """Serialize `message` and sign it under `domain`; returns the envelope."""
    body = canonical_bytes(message)
    return pb.Signed(body=body, public_key=identity.public_key, signature=identity.sign_raw(_tagged(domain, body)))


def envelope_id(envelope: pb.Signed) -> str:
    """Hex sha256 of the signed body: the content address of a signed message (e.g. a batch id)."""
    return hashlib.sha256(envelope.body).hexdigest()


def signer_id(envelope: pb.Signed) -> str:
    """Peer id of the envelope's signer (does not verify)."""
    return peer_id_from_public_key(bytes(envelope.public_key))


def open_signed(envelope: pb.Signed, domain: str, message_type: type[M]) -> tuple[M, str]:
    """Verify `envelope` under `domain` and parse its body.

    Returns:
        (message, signer peer id).
    Raises:
        SignatureError: reason "bad_signature" (invalid key/signature) or "malformed" (body does
            not parse as `message_type`).
    """
    if not verify_raw(bytes(envelope.public_key), bytes(envelope.signature), _tagged(domain, envelope.body)):
        raise SignatureError("bad_signature", f"{domain} envelope signature does not verify")
    message = message_type()
    try:
        message.ParseFromString(envelope.body)
    except DecodeError as exc:
        raise SignatureError("malformed", f"{domain} body: {exc}") from exc
    return message, signer_id(envelope)
