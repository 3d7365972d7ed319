"""The cold tier's entry format: b"TKV2" || u32 header length || msgpack header || 16-byte MAC || payload.

The header holds the format version, the model fingerprint, dtype, shape and the block's token ids.
The MAC is a keyed blake2b over the entry's database key, the header and the payload, keyed by a
secret that lives outside the cold folder (see `load_secret`): a block rewritten by someone without
the secret, checksum and all, is refused. Any mismatch (and a payload of another size than a block's)
is a miss plus a failure count, and the entry is moved to the `aside` database for inspection; never an
exception, never a wrong block. The key's fingerprint (not the key) is stored in the `meta` database: a
store opened under another key is refused at start-up (`check_key`) rather than rewritten entry by entry.
No pickle anywhere.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import struct
from pathlib import Path

import msgpack
import torch

from tieredkv.tiers.base import BlockKey, KVTier

log = logging.getLogger("tieredkv")

FORMAT_VERSION = 2
_MAGIC = b"TKV2"
_U32 = struct.Struct("<I")
MAC_BYTES = 16


def fingerprint_prefix(fingerprint: str) -> bytes:
    """The first 8 bytes of every key stored under this model fingerprint."""
    return hashlib.sha256(fingerprint.encode()).digest()[:8]


def default_secret_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "tieredkv" / "cold.key"


def load_secret(path: str | Path | None) -> bytes:
    """The key that authenticates cold entries: 32 random bytes in an owner-only file, created on first
    use. Processes that share a cold folder must share this file (the default is per user)."""
    path = Path(path) if path is not None else default_secret_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode) or st.st_size != 32:
        raise ValueError(f"{path} is not a cold-tier key (32 bytes in a regular file)")
    if st.st_mode & 0o077:
        log.warning("cold tier: %s was readable by others; making it owner-only", path)
        os.chmod(path, 0o600)
    return path.read_bytes()


def key_fingerprint(secret: bytes) -> bytes:
    """Names the key without revealing it: stored beside the entries, compared at start-up."""
    return hashlib.blake2b(b"tieredkv cold-tier key", key=secret, digest_size=8).hexdigest().encode()


class ColdFormat(KVTier):
    """Mixed into ColdTier and RemoteTier, which call `_init_format` and may override `_key` and
    `_set_aside` (what becomes of a bad entry); the KVTier counters count failures."""

    def _init_format(self, fingerprint: str, block_shape: tuple[int, ...], dtype: torch.dtype, secret_path) -> None:
        self.fingerprint = fingerprint
        self.prefix = fingerprint_prefix(fingerprint)
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.dtype_name = str(dtype).removeprefix("torch.")
        self.secret = load_secret(secret_path)

    @staticmethod
    def entry_bytes(block_shape: tuple[int, ...], dtype: torch.dtype, fingerprint: str, num_tokens: int) -> int:
        """Bytes of one entry's value (small token ids; larger ids add a few bytes)."""
        header = msgpack.packb({"v": FORMAT_VERSION, "fp": fingerprint, "dtype": str(dtype).removeprefix("torch."),
                                "shape": list(block_shape), "tokens": [0] * num_tokens})
        payload = torch.Size(block_shape).numel() * dtype.itemsize
        return len(_MAGIC) + _U32.size + len(header) + MAC_BYTES + payload

    def _blocks(self, data: bytearray, n: int) -> torch.Tensor:
        """n payloads laid end to end, as blocks [n, *block_shape] (no copy)."""
        return torch.frombuffer(data, dtype=self.dtype).view(n, *self.block_shape)

    @property
    def payload_bytes(self) -> int:
        return torch.Size(self.block_shape).numel() * self.dtype.itemsize

    # -- keys and values ---------------------------------------------------------------------------

    def _key(self, key: BlockKey) -> bytes:
        """The entry's key in the store (the MAC covers it: an entry copied under another key fails)."""
        return self.prefix + key.block_hash

    def _set_aside(self, key: BlockKey) -> None:
        """Called after an entry failed its checks (counted, logged)."""

    def _mac(self, db_key: bytes, header: bytes | memoryview, payload: bytes | memoryview) -> bytes:
        h = hashlib.blake2b(key=self.secret, digest_size=MAC_BYTES)
        h.update(db_key)
        h.update(header)
        h.update(payload)
        return h.digest()

    def _encode(self, key: BlockKey, block: torch.Tensor) -> bytes:
        payload = block.to(self.dtype).contiguous().view(torch.uint8).numpy().tobytes()
        header = msgpack.packb({"v": FORMAT_VERSION, "fp": self.fingerprint, "dtype": self.dtype_name,
                                "shape": list(self.block_shape), "tokens": list(key.token_ids)})
        mac = self._mac(self._key(key), header, payload)
        return _MAGIC + _U32.pack(len(header)) + header + mac + payload

    def _header(self, key: BlockKey | None, value: memoryview) -> tuple[dict, int]:
        """The entry's header and where its MAC starts; raises ValueError on any mismatch (token ids
        are compared unless key is None)."""
        if bytes(value[:4]) != _MAGIC:
            raise ValueError("bad magic (another format version, or not an entry)")
        (hlen,) = _U32.unpack(value[4:8])
        if 8 + hlen + MAC_BYTES > len(value):
            raise ValueError("truncated entry")
        header = msgpack.unpackb(bytes(value[8 : 8 + hlen]))
        if (not isinstance(header, dict) or header.get("v") != FORMAT_VERSION or header.get("fp") != self.fingerprint
                or header.get("dtype") != self.dtype_name or tuple(header.get("shape", ())) != self.block_shape
                or (key is not None and tuple(header.get("tokens", ())) != key.token_ids)):
            raise ValueError("header mismatch")
        return header, 8 + hlen

    def _verified(self, key: BlockKey, value: memoryview) -> memoryview:
        """The entry's authenticated payload; raises ValueError saying what does not match."""
        _, start = self._header(key, value)
        payload = value[start + MAC_BYTES :]
        if len(payload) != self.payload_bytes:
            raise ValueError(f"payload of {len(payload)} bytes, a block has {self.payload_bytes}")
        expected = self._mac(self._key(key), value[8:start], payload)
        if not hmac.compare_digest(expected, bytes(value[start : start + MAC_BYTES])):
            raise ValueError("authentication failed (changed without the key)")
        return payload

    def _payload(self, key: BlockKey, value: memoryview) -> memoryview | None:
        """The entry's authenticated payload, or None (a failure, and the entry is set aside) when
        anything does not match."""
        try:
            payload = self._verified(key, value)
        except Exception as e:  # any corrupt entry is a miss
            log.warning("%s tier: unusable entry %s: %s", self.name, key.block_hash.hex()[:12], e)
            self.count(failures=1)
            self._set_aside(key)
            return None
        return payload
