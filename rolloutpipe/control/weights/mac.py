"""The weights MAC: AES-GMAC over a policy's bytes, chunk by chunk, under keys that live one attempt. disk.py
authenticates its file with it, distributed.py each broadcast bucket.

Why GMAC. AES-GCM authenticating without encrypting runs at several times BLAKE3's speed per core on any host with
AES and carry-less multiply instructions (x86 since 2010, ARMv8): 20 GB/s on one core of the 2-core machine from
cache, 9 GB/s from memory. The side that checks hashes nothing else, so its check costs a fraction of the bytes' own
move. cryptography's AESGCM holds the GIL while it runs (measured with cryptography 48: a Python thread beside it
waits), so a chunk blocks the process's other Python threads for its ~30 ms; the copies beside it (torch's, file
writes, gloo's) run without the GIL.

Keys. The attempt's key gives the weights key (``weights_key``: an earlier attempt's MAC is worthless in this one).
Each message (a file, a bucket) has a fresh random salt published with it; its GMAC key is the weights key and the
salt through HMAC-SHA256 (``gmac_key``). Chunk i of a message (its tensors in order, each in MAC_CHUNK_BYTES pieces)
has nonce i, so no key and nonce pair ever authenticates two messages: GCM's one rule, whose breach gives the key
away.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from cryptography.hazmat.primitives.ciphers import AEADEncryptionContext, Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MAC_CHUNK_BYTES = 256 << 20
"""The bytes one GMAC authenticates at most (cryptography's AES-GCM takes under 2 GiB in one call)."""

SALT_BYTES = 16


def weights_key(attempt_key: bytes) -> bytes:
    """The 32-byte key of this attempt's weights MACs."""
    return hmac.new(attempt_key, b"rolloutpipe weights file", hashlib.sha256).digest()


def gmac_key(key: bytes, salt: bytes) -> bytes:
    """The AES key of the one message whose salt is ``salt`` (``key``: the weights key)."""
    return hmac.new(key, b"gmac" + salt, hashlib.sha256).digest()


class ChunkMac:
    """AES-GMAC of one message's chunks, under that message's own key (``gmac_key``)."""

    def __init__(self, key: bytes) -> None:
        self._key, self._aead = key, AESGCM(key)

    def tag(self, index: int, data: memoryview) -> bytes:
        """The 16-byte tag of chunk ``index`` (its nonce) holding ``data`` (holds the GIL meanwhile)."""
        return self._aead.encrypt(index.to_bytes(12, "big"), b"", data)

    def in_pieces(self, index: int) -> AEADEncryptionContext:
        """Chunk ``index``'s GMAC fed piece by piece: call ``authenticate_additional_data`` on each piece in order,
        then ``finalize()``; its ``tag`` is then ``tag(index, the pieces joined)``."""
        return Cipher(algorithms.AES(self._key), modes.GCM(index.to_bytes(12, "big"))).encryptor()

    def tags(self, tensors: Iterable[memoryview], first: int = 0) -> list[bytes]:
        """The tags of ``tensors``' chunks, each tensor cut alone, numbered from ``first``."""
        tags: list[bytes] = []
        for data in tensors:
            for begin, end in chunks(0, len(data)):
                tags.append(self.tag(first + len(tags), data[begin:end]))
        return tags


def chunks(begin: int, end: int) -> list[tuple[int, int]]:
    """The byte range [begin, end) in MAC_CHUNK_BYTES pieces; an empty range is one empty chunk."""
    return [(at, min(at + MAC_CHUNK_BYTES, end)) for at in range(begin, end, MAC_CHUNK_BYTES)] or [(begin, end)]
