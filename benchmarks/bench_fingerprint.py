"""What the weights' identity costs at start: the digest over every byte of the weight files (models/digest.py).

    .venv/bin/python benchmarks/bench_fingerprint.py                  # the default model
    .venv/bin/python benchmarks/bench_fingerprint.py --gib 13.5       # and a 7B-sized checkpoint (bf16: 13.5 GB)

For each checkpoint: the first start's digest with the files out of the page cache (where this process may
drop it: root on Linux) and in it, then a later start's (the kept record: a stat per file). The synthetic
checkpoint is one file of random bytes per 4.5 GiB shard (what is hashed is bytes, whatever they mean),
written to a temporary folder and removed after. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tieredkv.engine.resolve import resolve_model_dir  # noqa: E402
from tieredkv.models.digest import weights_digest  # noqa: E402
from tieredkv.models.loader import weight_files  # noqa: E402


def drop_page_cache() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def timed(files: list[Path], cache: Path, cold: bool) -> float | None:
    shutil.rmtree(cache, ignore_errors=True)
    if cold and not drop_page_cache():
        return None
    t0 = time.perf_counter()
    weights_digest(files, cache)
    return time.perf_counter() - t0


def measure(files: list[Path]) -> dict:
    cache = Path(tempfile.mkdtemp(prefix="digest-cache-"))
    try:
        first_cold = timed(files, cache, cold=True)
        first_warm = timed(files, cache, cold=False)
        t0 = time.perf_counter()
        weights_digest(files, cache)  # the record kept by the run above
        later = time.perf_counter() - t0
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    gb = sum(f.stat().st_size for f in files) / 1e9
    return {"files": len(files), "gb": round(gb, 3),
            "first_start_s_page_cache_cold": None if first_cold is None else round(first_cold, 2),
            "first_start_s_page_cache_warm": round(first_warm, 2),
            "gb_per_s_warm": round(gb / first_warm, 2),
            "later_start_ms": round(later * 1e3, 2)}


def synthetic(folder: Path, gib: float) -> list[Path]:
    files, left, i = [], int(gib * 2**30), 0
    while left > 0:
        n = min(left, int(4.5 * 2**30))
        path = folder / f"model-{i:05d}.safetensors"
        with open(path, "wb") as f:
            chunk = os.urandom(64 << 20)
            for _ in range(n // len(chunk)):
                f.write(chunk)  # (the same random block again: hashing costs the same for any bytes)
            f.write(chunk[: n % len(chunk)])
        files.append(path)
        left, i = left - n, i + 1
    return files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=0.0, help="also a synthetic checkpoint of this many GiB")
    args = ap.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    out = {"machine": cpu, "cores": os.cpu_count(), "sha_ni": "sha_ni" in flags,
           "default_model": measure(weight_files(resolve_model_dir("default")))}
    if args.gib:
        folder = Path(tempfile.mkdtemp(prefix="digest-7b-", dir=Path.home()))
        try:
            out[f"synthetic_{args.gib:g}_gib"] = measure(synthetic(folder, args.gib))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
