"""The cold tier's entry format: b"TKV1" || u32 header length || msgpack header || raw payload.

The header holds the format version, the model fingerprint, dtype, shape, the block's token ids and a
crc32 of the payload. Any mismatch is a miss plus a failure count (and the entry is removed), never an
exception and never a wrong block. No pickle anywhere.
"""

from __future__ import annotations

import logging
import struct
import zlib

import msgpack
import torch

from tieredkv.tiers.base import BlockKey

log = logging.getLogger("tieredkv")

FORMAT_VERSION = 1
_MAGIC = b"TKV1"
_U32 = struct.Struct("<I")


class ColdFormat:
    """Mixed into ColdTier: needs `prefix`, `fingerprint`, `dtype`, `dtype_name`, `block_shape`, `_queue`
    (to remove a bad entry) and the KVTier counters."""

    @staticmethod
    def entry_size(block_shape: tuple[int, ...], dtype: torch.dtype, fingerprint: str, num_tokens: int) -> int:
        """Bytes one entry takes against the budget (small token ids; larger ids add a few bytes)."""
        header = msgpack.packb({"v": FORMAT_VERSION, "fp": fingerprint, "dtype": str(dtype).removeprefix("torch."),
                                "shape": list(block_shape), "tokens": [0] * num_tokens, "crc": 2**32 - 1})
        payload = torch.empty(block_shape, dtype=dtype).numel() * dtype.itemsize
        return len(_MAGIC) + _U32.size + len(header) + payload

    # -- keys and values ---------------------------------------------------------------------------

    def _key(self, key: BlockKey) -> bytes:
        return self.prefix + key.block_hash

    def _encode(self, key: BlockKey, block: torch.Tensor) -> bytes:
        payload = block.to(self.dtype).contiguous().view(torch.uint8).numpy().tobytes()
        header = msgpack.packb({
            "v": FORMAT_VERSION, "fp": self.fingerprint, "dtype": self.dtype_name, "shape": list(self.block_shape),
            "tokens": list(key.token_ids), "crc": zlib.crc32(payload),
        })
        return _MAGIC + _U32.pack(len(header)) + header + payload

    def _header(self, key: BlockKey | None, value: memoryview) -> tuple[dict, int]:
        """The entry's header and where its payload starts; raises ValueError on any mismatch (token
        ids are compared unless key is None)."""
        if bytes(value[:4]) != _MAGIC:
            raise ValueError("bad magic")
        (hlen,) = _U32.unpack(value[4:8])
        header = msgpack.unpackb(bytes(value[8 : 8 + hlen]))
        if (header["v"] != FORMAT_VERSION or header["fp"] != self.fingerprint
                or header["dtype"] != self.dtype_name or tuple(header["shape"]) != self.block_shape
                or (key is not None and tuple(header["tokens"]) != key.token_ids)):
            raise ValueError("header mismatch")
        return header, 8 + hlen

    def _payload(self, key: BlockKey, value: memoryview) -> memoryview | None:
        """The entry's checked payload, or None (counted as a failure) when anything does not match."""
        try:
            header, start = self._header(key, value)
            payload = value[start:]
            if zlib.crc32(payload) != header["crc"]:
                raise ValueError("checksum mismatch")
        except Exception as e:  # any corrupt entry is a miss
            log.warning("cold tier: unusable entry %s: %s", key.block_hash.hex()[:12], e)
            self.count(failures=1)
            self._queue.put(("remove", [self._key(key)], None))
            return None
        return payload
