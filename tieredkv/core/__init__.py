"""The cache core: block pool, KV manager, scheduler, sequences, chained hashing, pins. Imports tiers, never the engine or the runner."""
