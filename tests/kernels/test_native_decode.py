"""The native decode step (kernels/decode_cpu.c through runner/native_decode.py): a one-sequence decode of a
model with quantized weights (or fp32 weights in oneDNN's packed layout, on builds with AVX-512), whole in C.
Checked against the eager forward on the same weights, step by step: the logits, the greedy tokens, and the K/V
rows it writes into the paged cache."""

import ctypes
import logging

import pytest
import torch

from helpers import drive, make_checkpoint, make_config, native_takes_fp32, run_to_end
from tieredkv import SamplingParams
from tieredkv.engine.engine_core import EngineCore
from tieredkv.kernels.quant_cpu import CPU
from tieredkv.runner.native_decode import NativeDecode

# a prompt longer than a block, and one long enough that attention splits its positions across the threads
PROMPTS = [[7, 3, 99, 14] * 5, list(range(20, 100))]
NEW = 10


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """q/k norms per head, a head_dim apart from hidden_size / heads"""
    return make_checkpoint(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", num_hidden_layers=2)


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory):
    """q/k/v and gate/up stored fused"""
    return make_checkpoint(tmp_path_factory.mktemp("tiny-phi3"), "phi3", num_hidden_layers=2)


@pytest.fixture
def served_build(lib, monkeypatch):
    """Engines the test starts run the `lib` fixture's build of the kernels (a start would otherwise load this
    processor's own build: CPU.use)."""
    served = CPU.lib
    monkeypatch.setattr(CPU, "use", lambda cache_dir, operators=True: CPU.serve_with(served, cache_dir, operators)
                        or True)
    return lib


def decode_logits(core: EngineCore, prompt: list[int], rows: slice = slice(-1, None)
                  ) -> tuple[list[int], list[torch.Tensor]]:
    """The greedy tokens and every step's logits (its last row, or `rows`) of one request served alone."""
    captured, inner = [], core.runner.execute
    core.runner.execute = lambda out: captured.append(inner(out)) or captured[-1]
    try:
        req = core.factory.make(prompt, SamplingParams(max_tokens=NEW, ignore_eos=True))
        assert core.add_request(req) == []
        drive(core)
    finally:
        core.runner.execute = inner
    return req.seqs[0].output_token_ids, [logits[rows].float().clone().squeeze(0) for logits, _ in captured]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "phi3"])
@pytest.mark.parametrize("scheme", [dict(quantization="int8"), dict(quantization="int4"),
                                    dict(quantization="int4", quantization_group_size=64,
                                         quantization_symmetric=True), dict()],
                         ids=["int8", "int4", "int4-sym-64", "fp32"])
def test_native_step_matches_the_eager_forward(engines, request, family, scheme):
    """Every decode step's logits within float rounding of the eager forward's on the same weights (the same
    product kernels; the norms, rotary embedding and softmax summed in another order), the same greedy tokens,
    and the same K/V rows in the cache (q/k/v biases: qwen2; per-head q/k norms: qwen3; fused q/k/v and gate/up
    as stored: phi3). fp32 weights: on builds that multiply several fp32 rows themselves (AVX-512)."""
    if not scheme and not native_takes_fp32():
        pytest.skip("the native step takes fp32 weights on builds with AVX-512 only")
    path = request.getfixturevalue(f"{family}_dir")
    cfg = dict(model=str(path), num_blocks=32, warm_bytes=0, enable_prefix_caching=False, **scheme)
    eager = engines.core(make_config(**cfg, compile_decode=False))
    native = engines.core(make_config(**cfg, compile_decode=True))
    try:
        assert native.stats().decode_path == "native" and isinstance(native.runner.compiled, NativeDecode)
        for prompt in PROMPTS:
            want_tokens, want = decode_logits(eager, prompt)
            got_tokens, got = decode_logits(native, prompt)
            assert got_tokens == want_tokens
            assert len(got) == len(want) == NEW
            for w, g in zip(want[1:], got[1:]):  # the prefill's, then each decode step's
                assert (w - g).abs().max() <= 1e-3 * w.abs().max(), (w - g).abs().max()
            # the same blocks (one request at a time, no prefix caching): every K/V row the decodes wrote
            # (an int16 activation code a rounding apart moves a row by ~2^-15 of its largest input, and later
            # layers carry it on)
            assert (native.kv_cache - eager.kv_cache).abs().max() <= 1e-3 * eager.kv_cache.abs().max()
            assert native.kv_cache.abs().amax(dim=(3, 4, 5)).gt(0).sum() == eager.kv_cache.abs().amax(
                dim=(3, 4, 5)).gt(0).sum()  # the same blocks written
        step = native.runner.compiled  # every decode, and a prompt as short as the step's longest chunk
        assert step.steps == sum(NEW - 1 + (len(p) <= step.max_rows) for p in PROMPTS)
    finally:
        eager.close()
        native.close()


@pytest.mark.parametrize("scheme", [dict(quantization="int4"), dict(quantization="int8", kv_cache_dtype="int8"), {}],
                         ids=["int4", "int8-kv8", "fp32-24-streams"])
def test_a_batch_of_decodes_is_one_native_step_with_the_eager_forwards_tokens(engines, llama_dir, scheme):
    """Sequences of different lengths (one across blocks, one whose attention splits across the threads) decoding
    together: each step is one native step, a row a sequence, each row attending through its own block table;
    every sequence's greedy tokens are the eager forward's, batched alike, and (an fp32 cache) its K/V rows within
    rounding of them. fp32 weights (builds with AVX-512): 24 streams, more than a quantized model's steps take and
    within the fp32 step's FP32_ROWS."""
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11], list(range(20, 100)), [3] * 17]
    new = [12, 9, 15, 10]  # the batch shrinks as they end
    if not scheme:
        if not native_takes_fp32():
            pytest.skip("the native step takes fp32 weights on builds with AVX-512 only")
        prompts += [[30 + i, 31 + i, 2 * i + 1] for i in range(20)]
        new += [4 + i % 7 for i in range(20)]
    cfg = dict(model=str(llama_dir), num_blocks=96, warm_bytes=0, enable_prefix_caching=False, **scheme)
    eager = engines.core(make_config(**cfg, compile_decode=False))
    native = engines.core(make_config(**cfg, compile_decode=True))
    try:
        assert native.runner.compiled.max_batch >= len(prompts)
        want, got = run_to_end(eager, prompts, new), run_to_end(native, prompts, new)
        assert got == want
        calls = native.stats().kernel_calls
        assert calls["forward: eager"] == 1 and calls["forward: native step"] == max(new) - 1
        assert "decode attention: CPU kernel" not in calls  # no decode ran eagerly
        if native.kv_cache.dtype == torch.float32:  # (int8 rows: codes, whose bytes a rounding moves by a step)
            assert (native.kv_cache - eager.kv_cache).abs().max() <= 1e-3 * eager.kv_cache.abs().max()
    finally:
        eager.close()
        native.close()


def test_a_short_prompt_joins_the_decodes_in_one_native_step(engines, llama_dir):
    """A prompt of a few tokens arriving while another sequence decodes: that step (the prompt's rows beside the
    decode, a block table a row) is a native step too, and both sequences' tokens are the eager forward's."""
    cfg = dict(model=str(llama_dir), quantization="int4", num_blocks=32, warm_bytes=0, enable_prefix_caching=False)
    outputs = []
    for compiled in (False, True):
        core = engines.core(make_config(**cfg, compile_decode=compiled))
        try:
            params = SamplingParams(max_tokens=6, ignore_eos=True)
            first, short = core.factory.make(PROMPTS[1], params), core.factory.make([9, 10, 11, 12, 13], params)
            drive(core, [first], each_step=lambda n, _: n == 2 and core.add_request(short))
            outputs.append([r.seqs[0].output_token_ids for r in (first, short)])
            calls = core.stats().kernel_calls
        finally:
            core.close()
    assert outputs[1] == outputs[0] and all(len(o) == 6 for o in outputs[1])
    assert calls["forward: eager"] == 1 and calls["forward: native step"] >= 6  # the long prompt's step alone


@pytest.mark.parametrize("background", [False, True], ids=["at start", "in the background"])
def test_the_native_step_binds_the_operators_the_batched_steps_run(engines, llama_dir, monkeypatch, background):
    """The native step takes decodes and short chunks; the eager forward's steps that mix a decode with a longer
    prompt run the C++ operators, which its warm-up binds as the compiled graph's does before its trace (in the
    background: by the time finish returns): their decode attention goes to the CPU kernel, not torch's reference."""
    monkeypatch.setattr(CPU, "bound", None)  # as in a fresh process
    core = engines.core(make_config(model=str(llama_dir), quantization="int4", num_blocks=32, warm_bytes=0,
                                    compile_decode=True, compile_in_background=background))
    try:
        assert isinstance(core.runner.compiled, NativeDecode)
        core.runner.compiled.finish()
        assert CPU.operators_bound
        reqs = [core.factory.make(p, SamplingParams(max_tokens=4, ignore_eos=True)) for p in PROMPTS]
        for req in reqs:  # each arrives as the one before decodes: its prompt and that decode in one eager step
            assert core.add_request(req) == []
            core.step()
        drive(core)
        assert all(len(r.seqs[0].output_token_ids) == 4 for r in reqs)
        calls = core.stats().kernel_calls  # the eager steps' decode attention ran the kernel
        assert calls["decode attention: CPU kernel"] > 0 and "decode attention: torch reference" not in calls
    finally:
        core.close()


def test_native_step_takes_only_what_it_can(engines, llama_dir, caplog):
    """Where the step cannot serve, `make` says why and the compiled graph does: a bfloat16 cache, weights neither
    quantized nor packed; where it can, it points at each layer's own K and V caches."""
    core = engines.core(make_config(model=str(llama_dir), quantization="int4", num_blocks=8, warm_bytes=0,
                                    compile_decode=True))
    plain = engines.core(make_config(model=str(llama_dir), num_blocks=8, warm_bytes=0, compile_decode=False,
                                     cpu_linear="torch"))
    try:
        step = core.runner.compiled
        assert isinstance(step, NativeDecode)
        layer = step._layers[1]
        assert layer.k_cache == core.kv_cache[1, 0].data_ptr() and layer.v_cache == core.kv_cache[1, 1].data_ptr()
        with caplog.at_level(logging.INFO, logger="tieredkv"):
            assert NativeDecode.make(core.model, core.kv_cache.to(torch.bfloat16)) is None
            assert NativeDecode.make(plain.model, plain.kv_cache) is None  # F.linear's plain weights
        assert "native decode step off" in caplog.text and "torch.bfloat16" in caplog.text
        assert "neither quantized nor packed" in caplog.text
        assert CPU.lib.tkv_decode_fits(ctypes.byref(step._model)) == 1
        for field, value in (("head_dim", 512), ("heads", 3), ("inter", step._model.inter + 16)):
            bad = type(step._model).from_buffer_copy(step._model)  # what the kernels cannot take is refused
            setattr(bad, field, value)
            assert CPU.lib.tkv_decode_fits(ctypes.byref(bad)) == 0, field
    finally:
        core.close()
        plain.close()


def test_native_step_reads_far_blocks_in_place(engines, llama_dir):
    """A document whose KV outgrows a hot pool of 8 blocks: its old blocks are far blocks in the warm tier's slab,
    the cache tensor's tail, which the native step's attention reads in place; the greedy tokens are those of an
    engine whose pool holds everything (eager forward, same int4 weights)."""
    from helpers import check_pool_clean, run_to_end

    rng = __import__("random").Random(1)
    document = [rng.randrange(3, 440) for _ in range(600)]
    block_bytes = 3 * 2 * 16 * 2 * 16 * 4  # tiny llama: layers * k|v * block * kv_heads * head_dim * fp32
    base = dict(model=str(llama_dir), quantization="int4")
    whole = engines.core(make_config(**base, num_blocks=64, warm_bytes=0, compile_decode=False))
    far = engines.core(make_config(**base, num_blocks=8, warm_bytes=100 * block_bytes, max_num_batched_tokens=256,
                                   offload="in_place", compile_decode=True))
    try:
        assert far.stats().decode_path == "native" and far.kv_cache.shape[2] == 8 + 100 + 1
        assert run_to_end(far, [document], [24]) == run_to_end(whole, [document], [24])
        assert far.runner.compiled.steps == 23 and far.runner.staged_steps == 0
        assert far.stats().blocks_offloaded >= 600 // 16 - 8
        check_pool_clean(far)
    finally:
        whole.close()
        far.close()


@pytest.mark.parametrize("scheme", [dict(quantization="int4"), dict(quantization="int8"),
                                    dict(quantization="int4", int8_activations=True)],
                         ids=["int4", "int8", "int4-tiles"])
def test_native_step_verifies_drafts_as_the_eager_forward(engines, served_build, llama_dir, phi3_dir, scheme):
    """Speculative decoding's verification (a sequence's last token and its drafts, one step): the native step's
    rows (every product reading its weight once for all of them, kernels/decode_cpu.c tkv_decode_rows) give the
    eager forward's logits on every row, and both engines the same tokens, for each build of the kernels."""
    from test_speculative import Oracle

    for path in (llama_dir, phi3_dir):
        prompt = PROMPTS[1]
        cfg = dict(model=str(path), num_blocks=32, warm_bytes=0, enable_prefix_caching=False,
                   speculative={"method": "ngram", "num_speculative_tokens": 5, "adaptive": False}, **scheme)
        plain = engines.core(make_config(**{**cfg, "speculative": None}, compile_decode=False))
        want_tokens, _ = decode_logits(plain, prompt)
        plain.close()
        runs = []
        for compiled in (False, True):
            core = engines.core(make_config(**cfg, compile_decode=compiled))
            core.parts.speculator.proposer = Oracle({tuple(prompt): want_tokens}, 10**6, spoil=2)
            runs.append(decode_logits(core, prompt, slice(None)) + (core.runner.compiled,))
            core.close()
        (eager_tokens, eager, _), (native_tokens, native, path_) = runs
        assert eager_tokens == native_tokens == want_tokens
        assert isinstance(path_, NativeDecode) and any(g.dim() == 2 and g.shape[0] > 2 for g in native)
        for w, g in zip(eager[1:], native[1:]):
            assert w.shape == g.shape
            assert (w - g).abs().max() <= 1e-3 * w.abs().max(), (w - g).abs().max()


def plain_then_drafted(cfg: dict, prompts: list[list[int]], check) -> tuple[list, list, object, int | None]:
    """Every token's TokenLogprob of greedy requests (one per prompt, all at once) decoded plainly, then in an engine
    with speculative decoding whose drafts are an oracle's (spoilt every third proposal); `check(core)` runs on each
    engine before it decodes. Returns both lists of lists (a request's each), the second engine's stats and its
    Scheduler.max_draft_rows."""
    from test_speculative import Oracle

    params = SamplingParams(max_tokens=2 * NEW, ignore_eos=True, logprobs=0)

    def logprobs(core: EngineCore) -> tuple[list, object, int | None]:
        try:
            check(core)
            reqs = [core.factory.make(p, params) for p in prompts]
            for req in reqs:
                req.sink = object()  # what a request's outputs come with
            out = drive(core, reqs)
            lists = [[lp for sink, chunk in out if sink is req.sink for lp in chunk.logprobs] for req in reqs]
            return lists, core.stats(), core.scheduler.max_draft_rows
        finally:
            core.close()

    plain, _, _ = logprobs(EngineCore(make_config(**cfg)))
    core = EngineCore(make_config(**cfg, speculative={"method": "ngram", "num_speculative_tokens": 5,
                                                       "adaptive": False}))
    core.parts.speculator.proposer = Oracle({tuple(p): [lp.token_id for lp in want] for p, want in zip(prompts, plain)},
                                            10**6, spoil=3)
    return (plain, *logprobs(core))


@pytest.mark.parametrize("scheme", [dict(quantization="int4"), dict(quantization="int8"),
                                    dict(quantization="int4", quantization_group_size=64,
                                         quantization_symmetric=True),
                                    dict(quantization="int4", kv_cache_dtype="int8"),
                                    dict(quantization="int4", kv_cache_dtype="int4"), dict(),
                                    dict(kv_cache_dtype="int8")],
                         ids=["int4", "int8", "int4-sym-64", "int4-kv8", "int4-kv4", "fp32", "fp32-kv8"])
@pytest.mark.parametrize("threads", [1, 3])
def test_native_verification_rows_are_plain_native_decoding_to_the_bits(request, served_build, llama_dir, scheme,
                                                                        threads):
    """A speculative step's rows through the native step give plain native decoding's log-probabilities bit for bit
    (the product kernels take a row's sums in one order for one row or several, quant_cpu.c q4_row; attention reads
    each row's positions as a decode step does: the rows whose splits agree go through each chunk of positions
    together, attention_cpu.c att_item, each as it would alone), so drafts never change a greedy token, however
    close its runner-up; on each build of the kernels, with 1 and 3 threads (2 and up to 4 splits of a row's
    positions, rows of 3 and of 4 splits in one verification). fp32 weights: on builds with AVX-512 (the several-row
    fp32 kernel, quant_cpu.c f32p_share: a row's sums the one-row kernel's)."""
    served = CPU.lib
    if "quantization" not in scheme and not CPU.f32_rows:
        pytest.skip("the native step takes fp32 weights on builds with AVX-512 only")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # (the kernels' OpenMP threads: one runtime with torch's)
    request.addfinalizer(lambda: torch.set_num_threads(before))

    def check(core: EngineCore) -> None:
        assert isinstance(core.runner.compiled, NativeDecode) and CPU.lib is served  # the build asked for

    cfg = dict(model=str(llama_dir), num_blocks=32, warm_bytes=0, enable_prefix_caching=False, compile_decode=True,
               **scheme)
    plain, drafted, stats, _ = plain_then_drafted(cfg, [PROMPTS[1]], check)
    spec = stats.speculative
    assert drafted == plain and len(plain[0]) == 2 * NEW
    assert spec.num_accepted_tokens > NEW // 2 and spec.num_draft_tokens > spec.num_accepted_tokens


def test_batched_verifications_are_native_steps_and_plain_batched_decoding_to_the_bits(served_build, llama_dir):
    """Sequences speculating together: every step after the prompts' is one native step, whatever drafts it holds
    (decodes and verifications side by side, a block table a row; the drafts cut to the rows it takes), so each
    sequence's log-probabilities are plain batched decoding's bit for bit. (Steps that mixed verifications with
    other sequences went through the eager forward, whose chunk attention and element-wise steps round otherwise.)"""
    most_rows = []

    def check(core: EngineCore) -> None:
        assert isinstance(core.runner.compiled, NativeDecode)
        most_rows.append(core.runner.compiled.max_batch)

    cfg = dict(model=str(llama_dir), num_blocks=32, warm_bytes=0, enable_prefix_caching=False, compile_decode=True,
               quantization="int4")
    prompts = [PROMPTS[1], PROMPTS[0], [3, 1, 4, 1, 5, 9, 2, 6]]
    plain, drafted, stats, max_draft_rows = plain_then_drafted(cfg, prompts, check)
    assert drafted == plain and [len(p) for p in plain] == [2 * NEW] * 3
    calls, spec = stats.kernel_calls, stats.speculative
    assert calls["forward: eager"] == 1 and calls["forward: native step"] >= 2  # the prompts' step, then native
    assert max_draft_rows is not None and max_draft_rows <= most_rows[-1] < 3 * 6  # 3 sequences, 5 drafts each
    assert spec.num_accepted_tokens > NEW and spec.num_draft_tokens > spec.num_accepted_tokens


def test_drafts_stay_below_the_int8_blocks_so_speculation_is_plain_decoding(llama_dir, monkeypatch):
    """Where int8 blocks take steps from a measured row count (forced to 4 here), an engine with speculative decoding
    multiplies as one without: the same count, and a step with drafts cut below it. A 12-token prompt (a step of
    int8 blocks in both engines) then decodes to plain decoding's log-probabilities bit for bit; before, the
    speculative engine kept the int16 rows up to 16 rows and differed from its first token."""
    from tieredkv.engine import rank_build
    from tieredkv.kernels.quant import QuantizedWeight

    monkeypatch.setattr(rank_build, "int8_many_rows_win", lambda *args, **kwargs: True)
    monkeypatch.setattr(rank_build, "int8_fewest_rows", lambda *args, **kwargs: 4)

    def check(core: EngineCore) -> None:
        if not CPU.int8_gemm:
            pytest.skip("int8 blocks need a build of the kernels with AVX2")
        assert {w.int8_rows for w in core.model.modules() if isinstance(w, QuantizedWeight)} == {4}

    cfg = dict(model=str(llama_dir), num_blocks=32, warm_bytes=0, enable_prefix_caching=False, compile_decode=True,
               quantization="int4")
    plain, drafted, stats, max_draft_rows = plain_then_drafted(cfg, [list(range(20, 32))], check)
    assert max_draft_rows == 3 and drafted == plain and stats.speculative.num_accepted_tokens > 0
