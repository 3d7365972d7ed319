"""Tiny real checkpoints made on the fly, and the transformers reference they are checked against."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent  # the project's root: what a child process puts on its path to import the package

# What the tests' engines run unless a test says otherwise (make_config): the eager forward, as compiling costs seconds
# per engine (test_compiled_decode.py, the transformers comparisons and the default-model tests ask for the compiled
# path); where a test does compile, start() waits for the graph, so that it knows which path serves
# (test_compiled_decode.py tests the background compile itself); and the core in the test's process, whose state
# the tests read through AsyncEngine.core (test_core_process.py, and every `tieredkv serve` the tests start, ask
# for a process of its own).
TEST_DEFAULTS = {"compile_decode": False, "compile_in_background": False, "core_process": False}


def make_config(**fields):
    """An EngineConfig of `fields`, with TEST_DEFAULTS for the fields not given (a field given as None takes the
    engine's own default for it, as in production)."""
    from tieredkv import EngineConfig

    return EngineConfig(**{**TEST_DEFAULTS, **fields})


CORPUS = [
    "The quick brown fox jumps over the lazy dog. ",
    "Paged attention keeps keys and values in fixed-size blocks. ",
    "A prefix cache serves shared system prompts once. ",
    "Élan, naïve café, smörgåsbord, 東京, 🙂🚀 and ünïcödé text. ",
    "Numbers 0123456789 and symbols !?.,;:()[]{}<>+-*/=_ ",
] * 20
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def make_tokenizer(out_dir: Path, vocab_size: int = 512, extra_special: tuple[str, ...] = ()):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>", *extra_special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    more = {"additional_special_tokens": list(extra_special)} if extra_special else {}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", **more)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def make_checkpoint(out_dir: Path, kind: str = "llama", seed: int = 0, extra_special: tuple[str, ...] = (),
                    **overrides) -> Path:
    """A random-initialised model of the given architecture saved as config.json + safetensors (`extra_special`:
    more special tokens in its tokenizer)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(out_dir, extra_special=extra_special)
    common = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.08,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
        with torch.no_grad():  # make the q/k/v biases matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    elif kind == "qwen3":  # q/k norms; a head_dim that is not hidden_size / heads, as Qwen3's own configs have
        from transformers import Qwen3Config, Qwen3ForCausalLM

        model = Qwen3ForCausalLM(Qwen3Config(**{"head_dim": 32, **common}))
        with torch.no_grad():  # norms that are not all ones, so that a missing one shows
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1, 0.3)
                layer.self_attn.k_norm.weight.normal_(1, 0.3)
    elif kind == "phi3":  # q/k/v and gate/up stored fused
        from transformers import Phi3Config, Phi3ForCausalLM

        model = Phi3ForCausalLM(Phi3Config(**{"pad_token_id": tok.eos_token_id, **common}))
    else:
        raise ValueError(kind)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir


def fresh_cache(path: Path) -> Path:
    """An engine cache directory at `path` with nothing in it but the run's CPU kernel builds (its `kernels/` is
    the default cache's, where every other engine of the run finds them): for a test that needs an empty cache
    for what it checks (a compile, a conversion, sleep's files) without compiling the kernels again (seconds)."""
    from tieredkv.cache_dir import default_cache_dir

    shared = default_cache_dir() / "kernels"
    shared.mkdir(parents=True, exist_ok=True)
    path.mkdir(parents=True, exist_ok=True)
    (path / "kernels").symlink_to(shared, target_is_directory=True)
    return path


def native_takes_fp32() -> bool:
    """Whether the native decode step takes fp32 weights on this processor: its own build of the CPU kernels (the
    one engines load) multiplies several fp32 rows itself (AVX-512; runner/native_decode.py)."""
    from tieredkv.cache_dir import default_cache_dir
    from tieredkv.kernels.quant_cpu import load

    lib = load(default_cache_dir())
    return lib is not None and bool(lib.tkv_f32_packed_rows_native())


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' generate, greedy, one prompt at a time, EOS ignored: the new token ids of each."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    out = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                               min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
            out.append(y[0, len(ids):].tolist())
    return out


def rand_ids(n: int, seed: int) -> list[int]:
    """n token ids in [3, 300), a function of the seed: a prompt no other test's shares by chance."""
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def check_pool_clean(core) -> None:
    """After everything finished: no reference held, every block free, nothing queued."""
    assert not core.scheduler.running and not core.scheduler.waiting
    assert all(b.ref_cnt == 0 for b in core.pool.blocks)
    assert core.pool.num_free == core.pool.num_blocks
    assert not core.requests
    assert not core.scheduler._computing  # no prompt block claimed as in flight
    warm = core.tiers.warm
    if warm is not None:  # every slot lent to a preempted sequence or as a far block came back
        assert len(warm.free_slots) + len(warm.entries) == warm.capacity
    assert core.pool.num_far == 0 and all(not core.pool.is_far(b) for b in core.pool.cached.values())


def check_pool_consistent(core) -> None:
    """At any time: ref_cnt = number of block tables holding the block; free iff ref_cnt 0."""
    holders: dict[int, int] = {}
    for seq in core.scheduler.running:
        for b in seq.block_table:
            holders[b.block_id] = holders.get(b.block_id, 0) + 1
    for seq in core.scheduler.waiting:
        assert not seq.block_table, "a waiting sequence holds blocks"
    free_ids = {b.block_id for b in core.pool.free_queue}
    assert len(free_ids) == core.pool.num_free
    for b in core.pool.blocks:
        assert b.ref_cnt == holders.get(b.block_id, 0), (b, holders.get(b.block_id, 0))
        assert (b.block_id in free_ids) == (b.ref_cnt == 0), b
    for h, b in core.pool.cached.items():
        assert b.block_hash == h
    assert core.pool.num_cached_free == sum(1 for b in core.pool.cached.values() if b.ref_cnt == 0)
    check_far_blocks(core, holders)


def check_far_blocks(core, holders: dict[int, int]) -> None:
    """Far blocks (held in warm slots): ref_cnt = holders, each one lent slot, findable by their hash."""
    pool = core.pool
    blocks = {b.block_id: b for s in core.scheduler.running for b in s.block_table if pool.is_far(b)}
    assert len(blocks) == pool.num_far
    for block_id, b in blocks.items():
        assert b.ref_cnt == holders[block_id], b
    far_cached = {h: b for h, b in pool.cached.items() if pool.is_far(b)}
    assert pool.num_cached_far == len(far_cached)
    assert all(far_cached[b.block_hash] is b for b in blocks.values() if b.block_hash in far_cached)
    assert all(b.block_id in blocks for b in far_cached.values())
    warm = core.tiers.warm
    if warm is None:
        return
    swapped = sum(s.swapped.num_blocks for s in core.scheduler.waiting if s.swapped is not None)
    lent = warm.capacity - len(warm.free_slots) - len(warm.entries)
    assert lent == len(blocks) + swapped
    slots = {pool.slot_of(bid) for bid in blocks}
    assert not slots & set(warm.free_slots) and not slots & {s for s, _ in warm.entries.values()}


class Engines:
    """The test run's engine factory (conftest's session fixture `engines`): `core(config)` builds an EngineCore,
    `await start(config)` an AsyncEngine on the test's loop, each over weights loaded once per worker process for
    every config that loads them alike (tieredkv.SharedWeights, keyed by the config's model, dtype, quantization, KV
    formats and kernels; a core process and tensor-parallel ranks load their own). Every engine is a new one (its
    own cache, tiers, scheduler and counters), closed by its test as any other: tests share the loaded weights,
    never an engine's state."""

    def __init__(self) -> None:
        from tieredkv import SharedWeights

        self.weights = SharedWeights()

    def core(self, config=None, **fields):
        """An EngineCore for `config` (or make_config(**fields))."""
        from tieredkv.engine.engine_core import EngineCore

        config = config or make_config(**fields)
        return EngineCore(config, self._weights_for(config))

    async def start(self, config=None, **fields):
        """An AsyncEngine for `config` (or make_config(**fields)) serving on the running loop."""
        from tieredkv import AsyncEngine

        config = config or make_config(**fields)
        return await AsyncEngine.start(config, shared_weights=self._weights_for(config))

    def _weights_for(self, config):
        """The shared weights, or None for a config that loads its own (a core process, tensor parallelism)."""
        return None if config.core_process or config.tensor_parallel_size > 1 else self.weights


def drive(core, requests=(), each_step=None, max_steps: int = 10_000) -> list:
    """The tests' one loop over an EngineCore: adds `requests`, then steps until the core has no work. Returns
    every (request, chunk or error) the adds and steps gave, in order. `each_step(n, outputs)` runs after step n
    (1, 2, ...) with that step's outputs: a check, an abort. A core still working after `max_steps` fails the test."""
    outputs = []
    for r in requests:
        outputs += core.add_request(r)
    steps = 0
    while core.has_work():
        assert steps < max_steps, f"the core still has work after {max_steps} steps"
        out = core.step()
        steps += 1
        outputs += out
        if each_step is not None:
            each_step(steps, out)
    return outputs


def run_to_end(core, prompts: list[list[int]], max_tokens: list[int], each_step=None) -> list[list[int]]:
    """Adds one greedy request per prompt (EOS ignored) to an EngineCore and steps until all are done
    (`each_step`: as drive's)."""
    from tieredkv import SamplingParams

    reqs = [core.factory.make(p, SamplingParams(max_tokens=n, ignore_eos=True), f"r{i}")
            for i, (p, n) in enumerate(zip(prompts, max_tokens))]
    for r in reqs:
        assert core.add_request(r) == []
    drive(core, each_step=each_step)
    return [r.seqs[0].output_token_ids for r in reqs]


def naive_decode(q, kc, vc, tables, lens, scale):
    """Decode attention written out per sequence and position: the reference the attention kernels meet."""
    bs = kc.shape[1]
    group = q.shape[1] // kc.shape[2]
    out = []
    for b, n in enumerate(lens):
        slots = [(int(tables[b, p // bs]), p % bs) for p in range(n)]
        k = torch.stack([kc[blk, off] for blk, off in slots])  # [n, Hkv, D]
        v = torch.stack([vc[blk, off] for blk, off in slots])
        k = k.repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[b], k) * scale, dim=-1)
        out.append(torch.einsum("hn,nhd->hd", p, v))
    return torch.stack(out)


async def cancel_midstream(engine, prompt: list[int], params) -> None:
    """Consumes a stream in a task and cancels the task once the first chunk came; the cancellation reaches it."""
    import pytest

    started = asyncio.Event()

    async def consume():
        async for _ in engine.stream(prompt, params):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
