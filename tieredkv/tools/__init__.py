"""Tools over an engine: plan, the cold-folder and snapshot commands, a local Valkey server for tests and
benchmarks."""
