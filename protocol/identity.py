"""Peer identities: Ed25519 key pairs, key files and peer ids.

A peer id is the first 20 bytes of sha256(raw public key), hex-encoded (40 characters), so it
can be recomputed by anyone holding the public key and can't be chosen independently of it.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64


def peer_id_from_public_key(public_key: bytes) -> str:
    """Return the peer id (40 hex chars) of a raw 32-byte Ed25519 public key.

    Raises:
        ValueError: the key is not 32 bytes.
    """
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise ValueError(f"Ed25519 public key must be {PUBLIC_KEY_BYTES} bytes, got {len(public_key)}")
    return hashlib.sha256(public_key).hexdigest()[:40]


def verify_raw(public_key: bytes, signature: bytes, message: bytes) -> bool:
    """Return True when `signature` is a valid Ed25519 signature of `message` by `public_key`.

    Malformed keys or signatures give False rather than raising: callers reject with a reason.
    """
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


@dataclass(frozen=True)
class Identity:
    """An Ed25519 key pair with its peer id."""

    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> Identity:
        """Create a fresh random identity."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """Deterministic identity from a 32-byte seed (tests and simulations only)."""
        if len(seed) != 32:
            raise ValueError(f"seed must be 32 bytes, got {len(seed)}")
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @property
    def public_key(self) -> bytes:
        """Raw 32-byte public key."""
        return self.private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @property
    def peer_id(self) -> str:
        """40-hex-character peer id derived from the public key."""
        return peer_id_from_public_key(self.public_key)

    def sign_raw(self, message: bytes) -> bytes:
        """64-byte Ed25519 signature of `message` (use signing.sign for protocol messages)."""
        return self.private_key.sign(message)

    def save(self, path: Path) -> None:
        """Write the private key as PEM (PKCS#8, unencrypted), created with mode 0600.

        Raises:
            FileExistsError: the file exists (keys are never overwritten silently).
        """
        pem = self.private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)

    @classmethod
    def load(cls, path: Path) -> Identity:
        """Read a key written by `save`.

        Raises:
            ValueError: the file is readable by group/others, or is not an Ed25519 key.
        """
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            raise ValueError(f"key file {path} has mode {oct(mode)}; it must be 0600 (chmod 600 {path})")
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"key file {path} does not hold an Ed25519 private key")  # noqa: TRY004 (bad input file)
        return cls(key)

    @classmethod
    def load_or_create(cls, path: Path) -> Identity:
        """Load the key at `path`, or create and save a new one there."""
        if path.exists():
            return cls.load(path)
        ident = cls.generate()
        ident.save(path)
        return ident
