"""Every Triton kernel variant a workload can ask for is compiled by the warm-up, before the first request.

Triton compiles one binary per kernel, argument types and specialisation classes, and constexpr values
(`triton_ops.variant_key`, computed by Triton's own binder). The kernels take everything that changes
with the batch as run-time arguments, so the set is fixed per model and device; here the warm-up's set is
recorded, then the variants of steps shaped like a workload's (batches of 1 to 64 decodes, contexts of 1
to max_model_len, cascades of 2 to 64 members, prefill chunks, block copies), and the second must be
inside the first. Dry runs: the launches are recorded, not run, so thousands of steps take seconds."""

import random

import pytest

from helpers import make_config
from tieredkv.engine.engine_core import EngineCore

triton_ops = pytest.importorskip("tieredkv.kernels.triton_ops")


def workload(max_len: int, max_seqs: int, bs: int, chunk: int):
    """(decode context lengths, prefill chunks) of steps a scheduler can form."""
    rng = random.Random(0)
    edges = sorted({1, 2, bs - 1, bs, bs + 1, 63, 64, 65, 511, 512, 513, 1000, max_len - 1, max_len})
    for ctx in edges:  # one sequence, every context class
        yield [ctx], []
    for n in (2, 3, 7, 16, 33, max_seqs):  # batches; mixed lengths; one cascade of n members (shared blocks)
        yield [rng.choice(edges) for _ in range(n)], []
        yield [max_len // 2] * n, []
    for n, ctx in ((1, 1), (5, 5), (bs, bs + 7), (chunk, chunk), (chunk, max_len), (37, 300)):
        yield [3, 700], [(n, ctx)]  # chunks beside decodes
        yield [], [(n, ctx), (min(n, 9), min(ctx, 90))]


@pytest.mark.parametrize("model", ["llama2_dir", "qwen2_dir"])  # 2 query heads per KV head; q/k/v bias
def test_no_workload_asks_for_a_variant_the_warm_up_did_not_compile(model, request):
    cfg = make_config(model=str(request.getfixturevalue(model)), attention_backend="triton", num_blocks=64,
                      warm_bytes=0, max_num_seqs=64)
    core = EngineCore(cfg)
    try:
        runner = core.runner
        assert runner.warmed_up
        with triton_ops.recording(dry_run=True) as warm:
            runner.warmup()
        kernels = {name for name, _ in warm}
        assert kernels == {"_store_kv_kernel", "_decode_split_kernel", "_decode_merge_kernel", "_prefix_kernel",
                           "_prefill_kernel", "_copy_chunks_kernel"}
        assert len(warm) == 7  # the split kernel twice (one split writes its output itself), the rest once
        with triton_ops.recording(dry_run=True) as asked:
            for decode_lens, prefills in workload(core.max_model_len, 64, cfg.block_size,
                                                  cfg.max_num_batched_tokens):
                runner.model.forward(runner.synthetic_step(decode_lens, prefills), runner.kv_cache, runner.ops)
            hot = core.tiers.hot  # the block moves' kernels, as the tier manager calls them
            data = hot.gather([3, 5, 6])
            hot.scatter([7, 9], data[:2])
            hot.copy([1, 2], [10, 11])
        assert asked - warm == set()
        assert {name for name, _ in asked} == kernels
    finally:
        core.close()


def test_the_key_tells_variants_apart():
    """The key is not blind: a batch-dependent argument left specialised would make new variants."""
    import torch

    key = torch.zeros(3, 2, 16)
    cache = torch.zeros(4, 16, 2, 16)
    args = [key, key, cache, cache, torch.zeros(3, dtype=torch.int64)] + [16] * 10
    meta = dict(BLOCK_SIZE=16, NUM_HEADS=2, HEAD_DIM=16, HD_PAD=32)
    base = triton_ops.variant_key(triton_ops._store_kv_kernel, tuple(args), meta)
    assert triton_ops.variant_key(triton_ops._store_kv_kernel, tuple(args[:5] + [17] + args[6:]), meta) != base
    assert triton_ops.variant_key(triton_ops._store_kv_kernel, tuple(args), {**meta, "HD_PAD": 64}) != base
    assert triton_ops.variant_key(triton_ops._store_kv_kernel, tuple(args), meta) == base
