"""Content-addressed files on the wire (data sets): chunking and chunk-by-chunk verification.

Pure (no network). A file travels as `AdapterChunk`s carrying data only (no signed header: the
content address in the signed job is the authority). The job names the file's sha256, size and
the sha256 of every `DATASET_CHUNK_BYTES` chunk, so a receiver refuses a tampered chunk as soon
as it arrives, before reading the rest, and checks the whole file's hash at the end.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence

from swarmrl.protocol.envs.dataset import DATASET_CHUNK_BYTES
from swarmrl.protocol.pb import swarm_pb2 as pb


class BlobError(ValueError):
    """Bytes that are not the file asked for (which chunk, and why)."""


def blob_chunks(data: bytes) -> Iterator[pb.AdapterChunk]:
    """Data-only chunks of `data`, `last` set on the final one."""
    n = max(1, -(-len(data) // DATASET_CHUNK_BYTES))
    for i in range(n):
        yield pb.AdapterChunk(data=data[i * DATASET_CHUNK_BYTES:(i + 1) * DATASET_CHUNK_BYTES], last=i == n - 1)


class BlobAssembler:
    """Reassembles one file, verifying each chunk against its expected sha256 as it arrives."""

    def __init__(self, sha256_hex: str, size: int, chunk_sha256: Sequence[str]) -> None:
        self.sha256_hex, self.size, self.expected = sha256_hex, size, list(chunk_sha256)
        self.parts: list[bytes] = []
        self.done = False

    def add(self, chunk: pb.AdapterChunk) -> None:
        """Take the next chunk.

        Raises:
            BlobError: a chunk after the last, more chunks than expected, a chunk whose sha256 is not
                the expected one, or a signed header (not a data chunk).
        """
        i = len(self.parts)
        if self.done or i >= len(self.expected):
            raise BlobError(f"chunk {i}: more chunks than the {len(self.expected)} expected")
        if chunk.HasField("header"):
            raise BlobError(f"chunk {i}: a data-set chunk carries no header")
        data = bytes(chunk.data)
        if hashlib.sha256(data).hexdigest() != self.expected[i]:
            raise BlobError(f"chunk {i}: sha256 mismatch (tampered or wrong file)")
        self.parts.append(data)
        self.done = bool(chunk.last)

    def result(self) -> bytes:
        """The verified file.

        Raises:
            BlobError: the stream ended early, or the whole file's size or sha256 is wrong.
        """
        if len(self.parts) != len(self.expected):
            raise BlobError(f"stream ended after {len(self.parts)} of {len(self.expected)} chunks")
        data = b"".join(self.parts)
        if len(data) != self.size or hashlib.sha256(data).hexdigest() != self.sha256_hex:
            raise BlobError("file sha256 or size mismatch")
        return data


def assemble_blob(chunks: Iterable[pb.AdapterChunk], sha256_hex: str, size: int, chunk_sha256: Sequence[str]) -> bytes:
    """`BlobAssembler` over a whole stream; stops reading at the first bad chunk (raises BlobError)."""
    asm = BlobAssembler(sha256_hex, size, chunk_sha256)
    for chunk in chunks:
        asm.add(chunk)
        if asm.done:
            break
    return asm.result()
