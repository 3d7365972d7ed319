"""Reading a checkpoint's files safely: regular files only (a FIFO or a device would never end), JSON of a
sane size."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from tieredkv.errors import CheckpointError, UnsupportedModelError

MAX_JSON_BYTES = 64 << 20  # config, generation config, index, tokenizer files are far smaller


def check_regular_files(model_dir: Path) -> None:
    """Every entry of the directory (links followed) is a regular file or a folder: a FIFO would hang
    whoever reads it, and a device (a link to /dev/zero, say) never ends."""
    for entry in model_dir.iterdir():
        try:
            mode = entry.stat().st_mode
        except OSError as e:
            raise CheckpointError(f"cannot read {entry.name}: {e}") from None
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise CheckpointError(f"{entry.name} in {model_dir} is not a regular file")


def read_json(path: Path, limit: int = MAX_JSON_BYTES) -> dict:
    """A JSON object from a regular file of at most `limit` bytes."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path.name} is not a regular file")
    if st.st_size > limit:
        raise CheckpointError(f"{path.name} has {st.st_size:,} bytes, more than a JSON file of a checkpoint can")
    with open(path, "rb") as f:
        try:
            value = json.loads(f.read(limit))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UnsupportedModelError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise UnsupportedModelError(f"{path} does not hold a JSON object")
    return value
