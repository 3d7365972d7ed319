"""Every Triton kernel variant fits every GPU generation it may meet: compiled offline with Triton's own
compiler and ptxas for sm_75, sm_80, sm_86, sm_89 and sm_90 (no GPU needed), registers at most 255, no
spills, shared memory within each target's limit (kernels/resources.py). One attention shape here, the
most demanding the table in docs/architecture.md covers (head_dim 128, 8 query heads per KV head); the
variants are those its warm-up compiles, with each target's tiles (triton_ops.Tiles), for the cache in the compute
dtype and in the KV formats (kernels/resources.py: KV_LAYOUTS)."""

import json
import os
import subprocess
import sys

from tieredkv.kernels.resources import SHARED_LIMIT


def test_every_kernel_variant_fits_every_target(tmp_path):
    out = tmp_path / "resources.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # this process's kernels interpret
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-m", "tieredkv.kernels.resources", "--shape",
                           "Llama-3-70B (64/8, d=128)", "--json", str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    kernels = {"_store_kv_kernel", "_store_kv_rows_kernel", "_decode_split_kernel", "_decode_merge_kernel",
               "_prefix_kernel", "_prefill_kernel", "_copy_chunks_kernel", "_quant_matmul_kernel"}
    assert {r["cc"] for r in rows} == set(SHARED_LIMIT)
    for cc in SHARED_LIMIT:
        assert {r["kernel"] for r in rows if r["cc"] == cc} == kernels
    # the split kernel twice (with and without its own output), the quantized product three times (q8, q8 with
    # offsets, q4); the KV formats' store, split (twice), prefix and prefill kernels for int8 K with int4 V, and
    # from sm_89 on for fp8
    assert len(rows) == 15 * len(SHARED_LIMIT) + 5 * sum(cc >= 89 for cc in SHARED_LIMIT)
    assert {r["constexprs"].split("K_FMT=")[1][:1] for r in rows if "K_FMT=" in r["constexprs"]} == {"-", "3", "5"}
    too_big = [r for r in rows if not r["fits"]]
    assert too_big == [], too_big
    for r in rows:
        assert r["registers"] <= 255 and r["spill_bytes"] == 0 and r["shared_bytes"] <= SHARED_LIMIT[r["cc"]]
