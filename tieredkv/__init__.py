"""tieredkv: an asyncio LLM engine with a paged, prefix-cached, tiered KV cache."""

from tieredkv.config import EngineConfig, SamplingParams
from tieredkv.engine import AsyncEngine, EngineClosedError
from tieredkv.engine_core import RequestError, StepError
from tieredkv.models.loader import CheckpointError
from tieredkv.models.spec import UnsupportedModelError
from tieredkv.outputs import CompletionOutput, EngineStats, RequestOutput, StreamChunk, Usage

__all__ = [
    "AsyncEngine",
    "CheckpointError",
    "CompletionOutput",
    "EngineClosedError",
    "EngineConfig",
    "EngineStats",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "StepError",
    "StreamChunk",
    "UnsupportedModelError",
    "Usage",
]
__version__ = "0.1.0"
