"""GPU benchmark of the Triton kernels and the engine's decode speed (needs CUDA; ~3 minutes).

    .venv/bin/python benchmarks/bench_kernels_gpu.py [--peak-gbs 4800]

1. Decode attention (bf16, 32 query heads, 8 KV heads, head_dim 128, block 16): achieved K/V read
   bandwidth as a fraction of the device's peak, and time vs the torch reference and vs torch SDPA
   on contiguous K/V of the same sizes.
2. Store-K/V and block gather/copy kernels: GB/s (bytes read + written).
3. Cascade decode (32 sequences over one shared 1,024-token prefix) against plain split-K decode;
   prefill attention TFLOP/s; the launch overhead of a tiny decode.
4. The engine on the default model: decode tokens/s at batch 1, 16 and 64.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch
import torch.nn.functional as F

# nominal HBM bandwidth in GB/s by device-name fragment
PEAK_GBS = {"H200": 4800, "H100": 3350, "A100": 2039, "L40S": 864, "A10": 600, "4090": 1008}


def bench_ms(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def decode_attention(peak_gbs: float) -> None:
    from tieredkv.kernels import triton_ops
    from tieredkv.kernels.decode_attention import decode_attention_ref

    hq, hkv, d, bs, dtype = 32, 8, 128, 16, torch.bfloat16
    print("\n## decode attention (bf16, 32/8 heads, head_dim 128, block 16)")
    print("| batch x context | triton ms | GB/s | % of peak | torch ref ms | SDPA contiguous ms |")
    print("|---|---|---|---|---|---|")
    for batch, ctx in [(1, 4096), (16, 4096), (64, 1024), (64, 4096)]:
        nb = batch * ctx // bs
        kc = torch.randn(nb + 1, bs, hkv, d, device="cuda", dtype=dtype)
        vc = torch.randn_like(kc)
        tables = torch.randperm(nb, device="cuda", dtype=torch.int32)[: nb].view(batch, ctx // bs)
        lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        q = torch.randn(batch, hq, d, device="cuda", dtype=dtype)
        t_tri = bench_ms(lambda: triton_ops.decode_attention(q, kc, vc, tables, lens, d**-0.5, ctx))
        t_ref = bench_ms(lambda: decode_attention_ref(q, kc, vc, tables, lens, d**-0.5, ctx), reps=10)
        kcont = torch.randn(batch, hkv, ctx, d, device="cuda", dtype=dtype)
        vcont = torch.randn_like(kcont)
        q4 = q.view(batch, hq, 1, d)
        t_sdpa = bench_ms(lambda: F.scaled_dot_product_attention(q4, kcont, vcont, enable_gqa=True))
        gbs = batch * ctx * hkv * d * 2 * kc.element_size() / t_tri / 1e6
        print(f"| {batch} x {ctx} | {t_tri:.3f} | {gbs:.0f} | {gbs / peak_gbs:.0%} | {t_ref:.3f} | {t_sdpa:.3f} |")


def movement_kernels() -> None:
    from tieredkv.kernels import triton_ops

    print("\n## KV movement kernels (bf16)")
    layers, nb, bs, h, d = 30, 4096, 16, 8, 128
    kv = torch.randn(layers, 2, nb, bs, h, d, device="cuda", dtype=torch.bfloat16)
    ids = torch.randperm(nb, device="cuda")[:512]
    staged = torch.empty(512, layers, 2, bs, h, d, device="cuda", dtype=torch.bfloat16)
    moved = staged.numel() * staged.element_size() * 2  # read + write
    t = bench_ms(lambda: triton_ops.gather_blocks(kv, ids, staged), reps=20)
    print(f"gather 512 blocks: {moved / t / 1e6:.0f} GB/s")
    t = bench_ms(lambda: triton_ops.copy_blocks(kv, ids[:256], ids[256:]), reps=20)
    print(f"copy 256 blocks in the pool: {moved / 2 / t / 1e6:.0f} GB/s")
    tokens = 8192
    k = torch.randn(tokens, h, d, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(nb * bs, device="cuda")[:tokens]
    t = bench_ms(lambda: triton_ops.store_kv(k, k, kv[0], slots))
    print(f"store K/V of {tokens} tokens: {k.numel() * k.element_size() * 4 / t / 1e6:.0f} GB/s")


def cascade_prefill_and_launch() -> None:
    from tieredkv.kernels import triton_ops

    hq, hkv, d, bs, dtype, batch = 32, 8, 128, 16, torch.bfloat16, 32
    scale = d**-0.5
    prefix, own = 1024 // bs, 64 // bs
    kc = torch.randn(prefix + batch * own + 1, bs, hkv, d, device="cuda", dtype=dtype)
    vc = torch.randn_like(kc)
    tables = torch.tensor([list(range(prefix)) + list(range(prefix + i * own, prefix + (i + 1) * own))
                           for i in range(batch)], device="cuda", dtype=torch.int32)
    lens = torch.full((batch,), (prefix + own) * bs, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, hq, d, device="cuda", dtype=dtype)
    plain = triton_ops.plan_decode(tables, lens, bs, dtype)
    grouped = triton_ops.plan_decode(tables, lens, bs, dtype, [(list(range(batch)), prefix)])
    t_plain = bench_ms(lambda: triton_ops.decode_attention(q, kc, vc, tables, lens, scale, plan=plain))
    t_casc = bench_ms(lambda: triton_ops.decode_attention(q, kc, vc, tables, lens, scale, plan=grouped))
    print("\n## cascade decode: 32 sequences over one shared 1,024-token prefix (+64 own tokens), bf16")
    print(f"plain split-K {t_plain:.3f} ms, cascade {t_casc:.3f} ms: {t_plain / t_casc:.2f}x")

    seqs, chunk, cached = 8, 512, 1024
    nb = (chunk + cached) // bs
    kc2 = torch.randn(seqs * nb + 1, bs, hkv, d, device="cuda", dtype=dtype)
    vc2 = torch.randn_like(kc2)
    tables2 = torch.arange(seqs * nb, device="cuda", dtype=torch.int32).view(seqs, nb)
    qsl = torch.arange(0, (seqs + 1) * chunk, chunk, device="cuda", dtype=torch.int32)
    lens2 = torch.full((seqs,), chunk + cached, device="cuda", dtype=torch.int32)
    q2 = torch.randn(seqs * chunk, hq, d, device="cuda", dtype=dtype)
    t_pre = bench_ms(lambda: triton_ops.prefill_attention(q2, kc2, vc2, tables2, qsl, lens2, scale, chunk))
    flops = 4 * seqs * chunk * (cached + chunk / 2) * hq * d  # QK and PV, causal over the chunk
    print(f"\n## prefill attention: {seqs} chunks of {chunk} after {cached} cached: {t_pre:.3f} ms, "
          f"{flops / t_pre / 1e9:.0f} TFLOP/s")

    q1, t1, l1 = q[:1], tables[:1, :1].contiguous(), torch.full((1,), 16, device="cuda", dtype=torch.int32)
    tiny = triton_ops.plan_decode(t1, l1, bs, dtype)
    t_small = bench_ms(lambda: triton_ops.decode_attention(q1, kc, vc, t1, l1, scale, plan=tiny), reps=200)
    print(f"\n## launch overhead: a 16-token decode takes {t_small * 1000:.1f} us")


async def engine_decode() -> None:
    from tieredkv import AsyncEngine, EngineConfig, SamplingParams

    print("\n## engine decode on the default model (cuda, bf16, Triton kernels)")
    async with await AsyncEngine.start(EngineConfig(model="default", device="cuda", max_num_seqs=64)) as engine:
        for batch in (1, 16, 64):
            params = SamplingParams(max_tokens=128, ignore_eos=True)
            prompts = [[100 + i] * 64 for i in range(batch)]
            await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=2)) for p in prompts))
            t0 = time.perf_counter()
            await asyncio.gather(*(engine.generate(p, params) for p in prompts))
            dt = time.perf_counter() - t0
            print(f"batch {batch}: {batch * 128 / dt:.0f} tokens/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peak-gbs", type=float, help="device HBM peak in GB/s (default: by device name)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs CUDA")
    name = torch.cuda.get_device_name()
    peak = args.peak_gbs or next((v for k, v in PEAK_GBS.items() if k in name), None)
    if peak is None:
        raise SystemExit(f"unknown peak bandwidth for {name}; pass --peak-gbs")
    print(f"device: {name}, nominal peak {peak:.0f} GB/s")
    decode_attention(peak)
    movement_kernels()
    cascade_prefill_and_launch()
    asyncio.run(engine_decode())


if __name__ == "__main__":
    main()
