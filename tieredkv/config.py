"""Validated configuration: the engine's `EngineConfig` and per-request `SamplingParams`."""

from __future__ import annotations

import os
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DType = Literal["auto", "float32", "bfloat16", "float16"]
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "int4", "fp8")
KVCacheDType = Literal["auto", "float32", "bfloat16", "float16", "int8", "int4", "fp8"]

ENV_PREFIX = "TIEREDKV_"  # EngineConfig.from_env: TIEREDKV_<FIELD> (the command line only)
SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes seeds below this
MAX_BEAM_WIDTH = 64
INT4_GROUP_SIZES = (32, 64, 128, 256)  # int4 weights' groups (kernels/quant.py): inputs sharing a scale
MAX_LENGTH_PENALTY = 10.0  # |length_penalty|: transformers' users pick 0.5-2; 10 already ranks by length alone
MIN_TEMPERATURE = 1e-5  # below this, sampling is greedy: logits / T would overflow long before it mattered


MAX_SPECULATIVE_TOKENS = 16  # drafts verified in one forward (vLLM and llama.cpp propose a few to a few tens)


class KVEventsConfig(BaseModel):
    """KV cache events for KV-aware routers (EngineConfig.kv_events_config), with vLLM's field names and defaults:
    what the hot pool caches and evicts, published on a ZMQ PUB socket in vLLM's format (engine/kv_events.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enable_kv_cache_events: bool = Field(False, description="publish events (nothing is recorded without it)")
    publisher: Literal["null", "zmq"] = Field("null", description='"zmq": a ZMQ PUB socket; "null": none')
    endpoint: str = Field("tcp://*:5557", description="the PUB socket's address: one with a wildcard (tcp://*:5557), "
                          "ipc:// or inproc:// is bound, any other connected to")
    replay_endpoint: str | None = Field(None, description="a ROUTER socket that answers a sequence number (8 bytes, "
                                        "big-endian) with the buffered batches from it on; None: no replay")
    buffer_steps: int = Field(10_000, ge=1, description="batches kept for replay")
    hwm: int = Field(100_000, ge=0, description="the PUB socket's high-water mark (messages)")
    max_queue_size: int = Field(100_000, ge=1, description="batches waiting to be sent before one is dropped")
    topic: str = Field("", description="the first frame of every message (subscribers filter on its prefix)")
    event_encoding: Literal["map", "array"] = Field(
        "map", description='"map": each event a map tagged under "type", as current vLLM sends them (vllm-router '
        'reads these); "array": the positional arrays of vLLM before it')


class SpeculativeConfig(BaseModel):
    """Speculative decoding (EngineConfig.speculative), in vLLM's shape: a proposer guesses the next tokens of a
    decoding sequence, and one forward scores them all; greedy output stays token for token what plain decoding
    gives, sampled output keeps its distribution (rejection sampling)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram", "draft"] = Field(
        ..., description='"ngram": prompt lookup, the tokens that followed the latest earlier occurrence of the '
        "sequence's last n tokens in its own prompt and output (vLLM's, transformers' prompt lookup); \"draft\": a "
        "draft model with the target's tokenizer proposes greedily (any checkpoint the engine loads, the target's "
        "own quantized copy included: model \"default\" with quantization \"gguf\")")
    num_speculative_tokens: int = Field(4, ge=1, le=MAX_SPECULATIVE_TOKENS,
                                        description="the most tokens proposed, and verified in one forward, a step")
    prompt_lookup_min: int = Field(2, ge=1, le=16, description="ngram: the shortest suffix looked up")
    prompt_lookup_max: int = Field(4, ge=1, le=16, description="ngram: the longest suffix looked up (tried first)")
    model: str | None = Field(None, description="draft: the draft model (as EngineConfig.model)")
    quantization: Literal["int8", "int4", "gguf"] | None = Field(
        None, description="draft: the draft model's weights (as EngineConfig.quantization)")
    adaptive: bool = Field(True, description="each sequence's draft length follows its measured acceptance and the "
                           "measured cost of longer steps (none where drafts do not pay); False: always "
                           "num_speculative_tokens where the proposer has them")
    disable_by_batch_size: int | None = Field(
        None, ge=1, description="no drafts while more sequences than this decode at once (a batch that large is "
        "compute-bound: verifying drafts costs as much as it saves); None: 8 on CPU, 32 on CUDA")

    @model_validator(mode="after")
    def _check(self) -> "SpeculativeConfig":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        if self.method == "draft" and not self.model:
            raise ValueError('speculative method "draft" needs a draft model: {"method": "draft", "model": ...}')
        if self.method != "draft" and (self.model is not None or self.quantization is not None):
            raise ValueError(f'speculative "model" and "quantization" apply to method "draft", not "{self.method}"')
        return self


class EngineConfig(BaseModel):
    """Everything the engine needs, validated once and passed whole.

    `num_blocks` wins over `kv_cache_bytes`; with neither, the KV pool takes
    `gpu_memory_utilization` of the device memory left after the weights on CUDA,
    and `cpu_kv_cache_bytes` (or what max_num_seqs sequences of max_model_len tokens take) on CPU.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field("default", min_length=1, description='"default", a local Hugging Face checkpoint directory, '
                       'or a Hugging Face repo id ("org/name", "org/name@revision"), from the local Hugging Face '
                       "cache or downloaded")
    cache_dir: str | None = Field(
        None, description="where the engine keeps what it builds once (the converted default model, the compiled "
        "decode graph); None: $TIEREDKV_CACHE_DIR, else $XDG_CACHE_HOME/tieredkv, else ~/.cache/tieredkv")
    dtype: DType = Field("auto", description='weights and KV: "auto" is float32 on CPU; on CUDA bfloat16 from '
                         "compute capability 8.0, float16 below it (no native bfloat16 there)")
    kv_cache_dtype: KVCacheDType = Field(
        "auto", description='how the KV cache stores keys and values, in every tier: "auto" at dtype; "bfloat16" or '
        '"float16" (16-bit storage under fp32 compute); "int8" (int8 codes and an fp16 scale per head_dim values of '
        'one token and KV head, as llama.cpp\'s q8_0); "int4" (keys less the model\'s key mean, measured at start; '
        'the row turned by a Walsh-Hadamard transform, then 4-bit codes of IQ4_NL\'s levels with an fp16 scale per '
        '32 values, as llama.cpp\'s iq4_nl); "fp8" (CUDA: e4m3 codes and an fp16 scale). Attention reads the codes '
        'where they lie')
    kv_cache_dtype_k: KVCacheDType | None = Field(None, description="K's format when it differs from "
                                                  "kv_cache_dtype (K is the more sensitive side)")
    kv_cache_dtype_v: KVCacheDType | None = Field(None, description="V's format when it differs from kv_cache_dtype")
    quantization: Literal["int8", "int4", "gguf"] | None = Field(
        None, description='weight-only quantization of the dense layers and the LM head: "int8" (per output row, '
        'symmetric), "int4" (groups of quantization_group_size inputs; the LM head in int8), both quantized at load '
        'from the checkpoint; "gguf": the GGUF file\'s own blocks (Q8_0/Q4_0/Q4_1 as they are; Q2_K..Q6_K, Q5_0, '
        "Q5_1 and IQ4_NL with every code kept) without a detour through fp32 (the default model's Q4_1 file, or "
        "the one *.gguf in the model directory); None: the weights in dtype")
    quantization_group_size: int = Field(32, description="int4: inputs per scale (32, 64, 128 or 256)")
    quantization_symmetric: bool = Field(False, description="int4: a scale per group and codes centred on 8 (else "
                                         "a scale and an offset per group)")
    int8_activations: bool | None = Field(
        None, description="CPU, quantized weights: when the activations are rounded to int8 in blocks of 32 inputs, as "
        "llama.cpp multiplies its blocks. None (default): in products of more rows than the one-row kernels take "
        "(prefill, long verification chunks, batched steps past 16 rows, 32 with AVX-512), on weights in groups of 32 "
        "or more (int8, int4, GGUF's Q8_0, Q4_0, Q4_1, Q4_K, Q5_0, ...) where the CPU kernels have AVX2 and that was "
        "measured clearly faster on the processor (the Q4_1 file's prefill 1.4x its rate through the dequantized fp32 "
        "product on an AMD EPYC Zen 3, perplexity +0.15% from fp32), and from fewer rows where the int8 blocks were "
        "measured clearly faster than the one-row kernels' int16 rows too (measured on an AMD EPYC Zen 3: from 12-16 "
        "rows on the Q4_1 file); smaller steps keep int16 rows, and so does a step with speculative drafts (they are "
        "cut below that count). True: also steps of up to 32 rows, with the weights held in tiles of 16 rows for "
        "AVX-512 VNNI (without it as None). False: never: int16 rows and, for more rows, the dequantized weight in the "
        "fp32 product (the closest to the weights' own product: greedy output as transformers' on the dequantized "
        "weights). See docs/guide/quantization.md")
    device: str = Field("auto", description='"auto", "cpu", "cuda" or "cuda:N"')
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV block")
    num_blocks: int | None = Field(None, ge=2, description="KV blocks in the hot pool (wins over every byte budget)")
    kv_cache_bytes: int | None = Field(None, gt=0, description="the hot pool's bytes on any device (wins over "
                                       "gpu_memory_utilization and cpu_kv_cache_bytes)")
    cpu_kv_cache_bytes: int | None = Field(
        None, gt=0, description="the hot pool's bytes on CPU, an upper bound (memory is taken as blocks are "
        "written); None: room for max_num_seqs sequences of max_model_len tokens, at most 2 GiB and an eighth of "
        "the machine's memory")
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0, description="CUDA: share of the device memory "
                                          "for weights, activations and the hot pool")
    max_model_len: int | None = Field(None, ge=1, description="longest sequence, prompt and output (None: the "
                                      "model's max_position_embeddings)")
    max_num_seqs: int = Field(64, ge=1, description="sequences running at once")
    max_num_batched_tokens: int = Field(1024, ge=1, description="tokens one step computes (prompt chunks and "
                                        "decodes)")
    enable_prefix_caching: bool = Field(True, description="serve prompt blocks computed before from the cache")
    scheduling_policy: Literal["shortest_prefill", "fcfs"] = Field(
        "shortest_prefill", description='which waiting request starts next: "shortest_prefill": the least prompt '
        "left to compute after its cached prefix (blocks another request is computing count as cached; a preempted "
        "one first; one overtaken by 2 x max_num_seqs later arrivals goes first, so none starves); \"fcfs\": "
        "arrival order")
    cascade_attention: bool = Field(True, description="decode sequences sharing a cached prefix read it once per "
                                    "step (where it pays; see kernels/cascade.py)")
    attention_backend: Literal["auto", "triton", "torch"] = Field(
        "auto", description='"auto": Triton kernels on CUDA; on CPU the project\'s C decode attention kernel (torch '
        'references for the rest); "torch": the torch references everywhere')
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads on CPU (default: torch's, one "
                                    "per core: measured 2x faster than 1 alone, equal beside busy processes)")
    share_cores: bool = Field(
        True, description="on CPU, with the core in a process of its own: while other processes keep the engine's "
        "cores busy (the application beside it), run each step on one thread fewer where that is measured faster "
        "for steps of its size; outputs unchanged to the bit (platform/cpu_share.py). Only where the engine has a "
        "thread per core, one rank")
    compile_decode: bool | None = Field(
        None, description="run a step that decodes one sequence through an inductor-compiled graph (compiled at "
        "start-up, cached under cache_dir), or, for quantized weights on CPU and for fp32 weights on CPUs with "
        "AVX-512, through the native C step (nothing to compile); None: on for CPU")
    native_decode: bool = Field(
        True, description="with compile_decode, a one-sequence decode runs whole in C (the native step) where it "
        "takes the model (quantized weights on CPU; fp32 weights in oneDNN's packed layout on a build with "
        "AVX-512), and so does a step that only decodes a few sequences or verifies their drafts (up to 16 rows, "
        "below the rows where products take int8 blocks); False: the compiled graph serves a one-sequence decode "
        "and the eager forward batches (stats().decode_path)")
    compile_in_background: bool = Field(
        True, description="compile the decode graph on a thread of its own while the eager forward serves, "
        "switching between two steps once it is ready (stats().decode_path says which serves); False: start() "
        "returns once it is compiled")
    cpu_linear: Literal["auto", "packed", "torch"] = Field(
        "auto", description='dense layers on CPU in fp32 (and bf16 with AVX512_BF16 or AMX), through oneDNN where '
        'its products match F.linear: "auto" holds the weights once (packed for oneDNN, or plain where the compiled '
        'decode path reads plain weights clearly faster on this processor, measured once); "packed" keeps a packed '
        'copy beside plain weights the compiled path reads (twice the memory, faster batched steps); "torch" keeps '
        'plain F.linear')
    cpu_malloc_tuning: bool = Field(True, description="on CPU, keep freed step buffers in glibc's heap")
    warm_bytes: int | None = Field(
        None, ge=0, description="host-memory tier budget; 0 turns it off; None: 10% of available RAM, at most 4 GiB"
    )
    offload: Literal["auto", "in_place", "staged", "off"] = Field(
        "auto", description="a sequence whose KV outgrows the hot pool keeps its older blocks in the warm tier, "
        'where attention reads them: "in_place" (CPU: the warm slab is the tail of the cache tensor), "staged" '
        '(copied per layer into a buffer for each step that reads them; what CUDA does, on CPU too); "auto": in '
        'place on CPU, staged on CUDA; "off": the sequence is preempted instead. True and False mean "auto" and '
        '"off"')
    cold_path: str | None = Field(None, description="directory of the LMDB disk tier; None turns it off")
    cold_bytes: int = Field(16 << 30, gt=0, description="disk budget of the cold tier (bytes on disk, whole pages)")
    cold_secret_path: str | None = Field(
        None, description="owner-only file with the key that authenticates cold entries, created on first use; "
        "None: ~/.config/tieredkv/cold.key. Processes sharing a cold_path must share it")
    remote_url: str | None = Field(
        None, description="Valkey or Redis server whose KV tier engines share (redis://host:port/db, rediss://, "
        "valkey://, unix:///path.sock; a cluster: any node's URL); None turns it off. The MAC key is "
        "cold_secret_path's: engines sharing a server must share it. Needs the remote extra")
    remote_timeout_s: float = Field(0.5, gt=0, description="limit of each call to the remote server: each socket "
                                    "read, and a lookup or read as a whole (one more round trip of at most 64 "
                                    "blocks may finish past it); a read over it is a miss and a failure, and a "
                                    "server that does not answer opens the circuit breaker")
    remote_retry_s: float = Field(10.0, gt=0, description="after a failed call, the remote tier makes no call for "
                                  "this long: lookups are misses, writes are dropped")
    remote_ttl_s: int | None = Field(86400, gt=0, description="lifetime of a remote entry, renewed by every read; "
                                     "None: none (the server's maxmemory policy alone bounds the tier)")
    max_pinned_fraction: float = Field(0.25, ge=0.0, le=0.9, description="share of the hot pool pin() may hold")
    max_pinned_per_client: float = Field(
        1.0, gt=0.0, le=1.0, description="share of the pinned budget one client may hold: a cache_salt (a tenant); "
        "requests without one are one client. Past it a pin is refused (the server: a 400). 1.0: no share below "
        "the budget; a server for several tenants sets less (0.25: four tenants can each pin their share)")
    idle_sleep_s: float | None = Field(
        None, gt=0, description="after this many seconds without a request or command, the engine sleeps "
        "(AsyncEngine.sleep at idle_sleep_level: its memory goes back to the system) until the next one, which "
        "wakes it (llama.cpp's --sleep-idle-seconds); None: never")
    idle_sleep_level: int = Field(1, ge=1, le=2, description="how deep idle_sleep_s sleeps: 1 the hot pool's memory, "
                                            "2 the weights' too (read back from a file on wake)")
    core_process: bool = Field(
        True, description="AsyncEngine runs the engine core (the model, the KV pool and tiers, every step) in a "
        "process of its own and talks to it over a socket, so that the application's own Python and torch work "
        "cannot slow a step (they would share the GIL and the cores' OpenMP threads with it). False: on a thread "
        "of the application's process, where AsyncEngine.core and run_in_worker(any callable) reach it")
    eviction_policy: Literal["lru", "lfu"] = Field(
        "lru", description='which cached blocks hot and warm give up first: "lru", the least recently used; '
        '"lfu", the least used, with dynamic aging (a use count per block, halved as the counts add up, plus the '
        "priority of the last block evicted: what was popular long ago does not stay forever). A chain's tail "
        "always leaves before its head")
    admit_min_uses: int = Field(
        1, ge=1, description="a block is written to the cold and remote tiers only once it has been used this many "
        "times (computed, or found by a prompt), or when a client marked it (pin, cache_control, prompt_cache_key); "
        "1: every block. Blocks refused are dropped where they would have gone down (TierStats.refused)")
    admit_output_blocks: bool = Field(
        True, description="blocks holding generated tokens go to the cold and remote tiers too; False: only prompt "
        "blocks (vLLM's offload_prompt_only), unless a prompt finds them later")
    speculative: SpeculativeConfig | None = Field(
        None, description='speculative decoding, a SpeculativeConfig or its dict: {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4} or {"method": "draft", '
        '"model": ..., "quantization": ..., "num_speculative_tokens": 4}; None: off')
    lora_adapters: dict[str, str] | None = Field(
        None, description="LoRA adapters in PEFT's format served beside the base model, by name: {name: folder}; "
        "on the command line --lora name=folder[,name=folder]. A request picks one by name (the server: its "
        '"model"); load_adapter / unload_adapter change them at run time')
    max_loras: int = Field(8, ge=1, description="LoRA adapters held in memory at once; using another reads it "
                           "again from its folder, dropping the least recently used")
    max_lora_rank: int = Field(64, ge=1, le=1024, description="the largest LoRA rank an adapter may have")
    kv_events_config: KVEventsConfig | None = Field(
        None, description='KV cache events for KV-aware routers, a KVEventsConfig or its dict in vLLM\'s shape: '
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}; None: off. Needs the '
        "fleet extra (pyzmq)")
    tensor_parallel_size: int = Field(
        1, ge=1, le=64, description="processes the model is split across (Megatron-style: heads, MLP columns and "
        "vocabulary rows), one per device: cuda:0..N-1 (from the device's index), or N CPU processes over gloo; "
        "rank 0 is this process and schedules. The compiled decode path is off above 1")

    @model_validator(mode="after")
    def _check_activations(self) -> "EngineConfig":
        if self.int8_activations and self.quantization is None:
            raise ValueError("int8_activations applies to quantized weights: set quantization too (int8, int4 or "
                             "gguf)")
        return self

    @model_validator(mode="after")
    def _check_parallel(self) -> "EngineConfig":
        if self.tensor_parallel_size == 1:
            return self
        if self.compile_decode:
            raise ValueError("compile_decode is not supported with tensor_parallel_size > 1")
        if self.quantization == "gguf":
            raise ValueError('quantization "gguf" is not supported with tensor_parallel_size > 1 (its blocks are '
                             'not split across ranks): use "int8" or "int4" on the safetensors checkpoint')
        return self

    @property
    def kv_cache_dtypes(self) -> tuple[str, str]:
        """The K and V formats' names ("auto": the compute dtype)."""
        return self.kv_cache_dtype_k or self.kv_cache_dtype, self.kv_cache_dtype_v or self.kv_cache_dtype

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **given: Any) -> "EngineConfig":
        """The config of a command-line tool: each field from the environment variable TIEREDKV_<FIELD>
        when it is set (TIEREDKV_COMPILE_DECODE=0, TIEREDKV_WARM_BYTES=0, ...; "none" for None), then the
        `given` values that are not None (the command's own arguments; "none" for None here too) over them.
        Only the command line calls this: an engine made in Python reads no environment variable for its
        settings."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            raw = environ.get(ENV_PREFIX + name.upper(), "")
            if raw != "":
                values[name] = None if raw.lower() == "none" else raw
        values.update({k: None if isinstance(v, str) and v.lower() == "none" else v
                       for k, v in given.items() if v is not None})
        return cls.model_validate(values)

    @field_validator("offload", mode="before")
    @classmethod
    def _offload_switch(cls, v: Any) -> Any:
        """offload=True / False (and "1"/"0", "true"/"false" from the environment) are "auto" / "off"."""
        if isinstance(v, str) and v.strip().lower() in ("1", "true", "yes", "0", "false", "no"):
            v = v.strip().lower() in ("1", "true", "yes")
        if isinstance(v, bool):
            return "auto" if v else "off"
        return v

    @field_validator("lora_adapters", mode="before")
    @classmethod
    def _lora_pairs(cls, v: Any) -> Any:
        """The command line's --lora gives "name=folder[,name=folder]" (or a JSON object)."""
        if isinstance(v, str):
            import json

            if v.lstrip().startswith("{"):
                return json.loads(v)
            pairs = [p.strip() for p in v.split(",") if p.strip()]
            if not all("=" in p for p in pairs):
                raise ValueError(f"lora_adapters takes name=folder[,name=folder], not {v!r}")
            return dict(p.split("=", 1) for p in pairs)
        return v

    @field_validator("speculative", "kv_events_config", mode="before")
    @classmethod
    def _json_object(cls, v: Any, info) -> Any:
        """The command line's --speculative and --kv-events-config (and their TIEREDKV_ variables) give JSON text."""
        if isinstance(v, str):
            import json

            try:
                return json.loads(v)
            except ValueError as e:
                raise ValueError(f"{info.field_name} must be a JSON object: {e}") from e
        return v

    @field_validator("quantization_group_size")
    @classmethod
    def _check_group(cls, v: int) -> int:
        if v not in INT4_GROUP_SIZES:
            raise ValueError(f"quantization_group_size must be one of {INT4_GROUP_SIZES}, got {v}")
        return v

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        if v in ("auto", "cpu", "cuda") or (v.startswith("cuda:") and v[5:].isdigit()):
            return v
        raise ValueError(f'device must be "auto", "cpu", "cuda" or "cuda:N", got {v!r}')


class SamplingParams(BaseModel):
    """How to sample one request. `temperature` below MIN_TEMPERATURE (0 included) is greedy; `n` samples
    share the prompt's KV blocks, and sample i of a seeded request draws from seed + i."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    max_tokens: int = Field(256, ge=1, description="the most tokens to generate per sample (the context may end "
                            "the output earlier: finish reason \"length\")")
    temperature: float = Field(0.0, ge=0.0, description="divides the logits before sampling; below 1e-5 (0 "
                               "included) is greedy")
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="sample from the fewest most likely tokens whose "
                         "probabilities sum to at least this; 1 is off")
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT, description="the request's own random generator (sample "
                             "i draws from seed + i): the same seed gives the same output whatever else is "
                             "batched; None: unseeded")
    stop: list[str] = Field(default_factory=list, description="strings that end the output (not included in it; "
                            "never split across chunks)")
    stop_token_ids: list[int] = Field(default_factory=list, description="tokens that end the output, besides "
                                      "the model's EOS (included in the token ids)")
    ignore_eos: bool = Field(False, description="go on past EOS until max_tokens or a stop rule")
    skip_special_tokens: bool = Field(True, description="leave special tokens out of the output text (False: keep "
                                      "them, as tool-call formats marked by a special token need)")
    n: int = Field(1, ge=1, le=256, description="parallel samples; they share the prompt's KV blocks (for beam "
                   "search: how many of the best beams come back)")
    logprobs: int | None = Field(None, ge=0, le=20, description="return each sampled token's log-probability "
                                 "and this many top alternatives' (raw model distribution)")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="subtracted once from every token already "
                                    "in the output (OpenAI)")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="subtracted per occurrence in the output")
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="divides positive / multiplies negative "
                                      "logits of tokens in the prompt or output (transformers); 1 is off")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="drop tokens below min_p x the top token's probability")
    min_tokens: int = Field(0, ge=0, description="EOS, stop tokens and stop strings cannot end the output before this")
    logit_bias: dict[int, float] = Field(default_factory=dict, description="token id -> bias added to its logit "
                                         "(-100 to 100)")
    beam_width: int = Field(1, ge=1, le=MAX_BEAM_WIDTH, description="above 1: beam search over this many beams "
                            "(transformers' num_beams); the n best beams come back, best first")
    length_penalty: float = Field(1.0, ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY,
                                  description="beam search: a finished beam scores its summed log-probability "
                                  "/ (output tokens ** length_penalty); above 0 favours longer outputs "
                                  f"(within ±{MAX_LENGTH_PENALTY:g}: past that the length alone decides)")
    json_schema: dict[str, Any] | None = Field(
        None, description="structured output: only tokens that keep the output a prefix of a JSON document valid "
        "under this JSON schema are sampled ({\"type\": \"object\"}: any JSON object); the output ends once the "
        "document is complete (needs llguidance: the structured extra)")
    grammar: str | None = Field(
        None, description="structured output by a grammar: a Lark grammar in llguidance's syntax (JSON schemas "
        "embedded with %json, lazy lexemes for text before a marker, as the server's tool calls use); only tokens "
        "that keep the output a prefix of a sentence of it are sampled, and the output ends once nothing can follow "
        "(not with json_schema)")
    speculative: bool | None = Field(
        None, description="speculative decoding for this request: None follows the engine (on where it has "
        "EngineConfig.speculative), False turns it off, True requires it (an engine without a proposer rejects "
        "the request)")
    early_stopping: bool | Literal["never"] = Field(
        False, description="beam search (transformers' meaning): True stops once beam_width beams finished; False "
        "stops when no running beam can score better by the current length; \"never\" by the longest allowed")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v):
        return [v] if isinstance(v, str) else v

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, v: dict[int, float]) -> dict[int, float]:
        bad = {t: b for t, b in v.items() if not -100.0 <= b <= 100.0}
        if bad:
            raise ValueError(f"logit_bias values must be within [-100, 100]; got {bad}")
        return v

    @model_validator(mode="after")
    def _seeds_fit(self) -> "SamplingParams":
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})")
        if self.beam_width > 1:
            self._check_beams()
            if self.constraint is not None:
                raise ValueError(f"{self.constraint[0]} is not applied to beam search")
            if self.speculative:
                raise ValueError("speculative decoding is not applied to beam search (it keeps its own path)")
        if self.json_schema is not None and self.grammar is not None:
            raise ValueError("json_schema and grammar cannot both be set: a request follows one grammar")
        if self.seed is not None and self.seed + self.n - 1 >= SEED_LIMIT:
            raise ValueError(f"seed + n - 1 must be below 2**64 (sample i uses seed + i); got seed={self.seed}, "
                             f"n={self.n}")
        return self

    @property
    def constraint(self) -> tuple[str, Any] | None:
        """("json_schema", schema), ("grammar", lark text), or None: what structured output follows."""
        if self.json_schema is not None:
            return "json_schema", self.json_schema
        if self.grammar is not None:
            return "grammar", self.grammar
        return None

    def _check_beams(self) -> None:
        if self.n > self.beam_width:
            raise ValueError(f"n ({self.n}) exceeds beam_width ({self.beam_width}): beam search returns at most "
                             "beam_width beams")
        if not self.greedy:
            raise ValueError("beam search is deterministic: temperature must be 0 with beam_width > 1")
        if self.logprobs is not None:
            raise ValueError("logprobs are not returned with beam search (each beam has its cumulative_logprob)")

    @property
    def greedy(self) -> bool:
        """True when sampling takes the most likely token (temperature below MIN_TEMPERATURE)."""
        return self.temperature < MIN_TEMPERATURE

    @property
    def beam_search(self) -> bool:
        """True when the request runs a beam search (beam_width above 1)."""
        return self.beam_width > 1

    @property
    def num_seqs(self) -> int:
        """Sequences the request may run at once: its samples, or its beams."""
        return max(self.n, self.beam_width)
