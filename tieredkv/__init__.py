"""tieredkv: an asyncio LLM engine with a paged, prefix-cached, tiered KV cache."""

from tieredkv.config import EngineConfig, KVEventsConfig, SamplingParams, SpeculativeConfig
from tieredkv.engine.async_engine import AsyncEngine
from tieredkv.engine import core_client  # noqa: F401  (serves AsyncEngine.start's default, core_process=True)
from tieredkv.engine.outputs import CompletionOutput, EngineStats, RequestOutput, StreamChunk, Usage
from tieredkv.engine.shared_weights import SharedWeights
from tieredkv.errors import (CheckpointError, ColdTierError, EngineClosedError, KVEventsError, LoRAError,
                             ModelNotFoundError, RankLostError, RankStartError, RemoteTierError, RequestError,
                             SamplingError, SnapshotError, StepError, TieredKVError, UnsupportedModelError,
                             WrongLoopError)
from tieredkv.models.tokenizer import Chat

__all__ = [
    "AsyncEngine",
    "Chat",
    "CheckpointError",
    "ColdTierError",
    "CompletionOutput",
    "EngineClosedError",
    "EngineConfig",
    "KVEventsConfig",
    "KVEventsError",
    "LoRAError",
    "EngineStats",
    "ModelNotFoundError",
    "RankLostError",
    "RankStartError",
    "RemoteTierError",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "SamplingError",
    "SharedWeights",
    "SnapshotError",
    "StepError",
    "SpeculativeConfig",
    "StreamChunk",
    "TieredKVError",
    "UnsupportedModelError",
    "Usage",
    "WrongLoopError",
]
__version__ = "0.1.0"
