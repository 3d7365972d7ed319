"""The cache core: KV manager, scheduler, sequences, beam search, the cache index, pins. Imports tiers and models,
never the runner or the engine."""
