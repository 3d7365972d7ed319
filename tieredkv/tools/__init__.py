"""Tools over a running engine: plan, explain, cache snapshots and their command-line commands."""
