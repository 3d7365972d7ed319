"""Tensor parallelism: one model split across processes (torch.distributed), rank 0 scheduling."""
