"""The engine: the asyncio front (AsyncEngine, streams), the worker thread that owns the engine core, the
request lifecycle (sampling, logits processors, structured output, beam steps), assembly from a config
(resolve, sizing, identity, rank_build, build), tensor-parallel ranks, explain and cache snapshots."""
