"""Tensor-parallel ranks: rank 0 is the engine's own process (it schedules, samples and holds the tiers' indexes);
ranks 1..N-1 are processes it starts (torch.multiprocessing, spawn) that hold their share of the weights and of
every KV block (hot and warm), and carry out what rank 0 broadcasts, in lockstep with it. After the start (a hello
from each rank, the group, the cache's sizes) rank 0 sends one kind of message, a step, then a close:

- ("step", ops, control, warmup, rows): the block ops recorded since the last step (tiers/block_io.py: the step's
  moves, on every rank's own shard; only what reaches or leaves a tier of whole blocks gathers heads to rank 0 or
  scatters them from it, so the tiers below hot hold whole blocks, in the format of one process, and serve any
  tensor-parallel size); changes to the LoRA adapters served (`control`); whether to run the kernel warm-up's
  forwards; and the rows of one forward over the sequences rank 0 scheduled (`describe`: each one's chunk of
  tokens, its computed length and its block table, the same block ids on every rank), or None;
- ("close",): the end.

A rank that dies makes rank 0's next collective fail: the engine closes (RankLostError, an EngineClosedError)."""

from __future__ import annotations

import datetime
import logging
import queue
import socket
from collections import Counter
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tieredkv.config import EngineConfig
from tieredkv.errors import RankStartError, TieredKVError
from tieredkv.models.tp_group import TPGroup
from tieredkv.models.tp_shard import Shard
from tieredkv.platform.process import exit_without_teardown
from tieredkv.runner.step_plan import rebuild
from tieredkv.tiers.block_io import BlockIO

log = logging.getLogger("tieredkv")
START_TIMEOUT_S = 120.0  # a rank that has not started by then (imported torch, opened its device) is an error
GROUP_TIMEOUT = datetime.timedelta(minutes=30)  # a collective longer than this fails (a hung rank, not a dead one)


class LeaderGroup(TPGroup):
    """Rank 0's group: the collectives, the step messages it sends (counted by kind in `messages`, the control
    changes they carried in `controls`) and the processes it started. `io`: rank 0's block ops (the engine's)."""

    def __init__(self, shard: Shard, device: torch.device, procs: list):
        super().__init__(shard, device)
        self.procs = procs
        self.io: BlockIO | None = None
        self.messages: Counter[str] = Counter()
        self.controls: Counter[str] = Counter()

    def drive(self, io: BlockIO) -> None:
        self.io, io.send = io, self.step

    def step(self, rows: list[tuple] | None = None, warmup: bool = False, control: Sequence[tuple] = ()) -> None:
        """Sends a step: the block ops recorded since the last one, which then run here too, `control` changes
        (("lora", "register", name, path) / ("lora", "unregister", name)), the warm-up, and a forward's rows."""
        batch = self.io.take() if self.io is not None else []
        self.broadcast(("step", [r.op for r in batch], list(control), warmup, rows))
        self.messages["step"] += 1
        self.controls.update(c[0] for c in control)
        if batch:
            self.io.run(batch)

    def abort(self) -> None:
        """Ends every rank at once (start-up failed: they may be waiting in any collective)."""
        self.broken = self.broken or RankStartError("aborted")
        for p in self.procs:
            p.kill()
            p.join(timeout=5)
        _leave_group()

    def close(self) -> None:
        """Ends every rank: a close command while they answer, then a join and a kill for one that lingers;
        with the group broken (a rank gone, or the ranks out of step) the others are killed at once."""
        try:
            if self.broken is None:
                self.broadcast(("close",))
                self.messages["close"] += 1
        except TieredKVError:
            pass
        for p in self.procs:
            p.join(timeout=0 if self.broken is not None else 10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        _leave_group()


def _leave_group() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a group whose peers are gone may fail to tear down; the process goes on
            log.debug("destroying the process group failed", exc_info=True)


def rank_device(cfg: EngineConfig, rank: int, device: torch.device) -> torch.device:
    """Rank r's device: cuda:(i + r) where rank 0 runs on cuda:i; the CPU for every rank on CPU."""
    if device.type != "cuda":
        return device
    index = (device.index or 0) + rank
    if index >= torch.cuda.device_count():
        raise RankStartError(f"tensor_parallel_size {cfg.tensor_parallel_size} from {device} needs cuda:{index}, "
                             f"but {torch.cuda.device_count()} CUDA device(s) are visible")
    return torch.device("cuda", index)


def start_ranks(cfg: EngineConfig, model_dir: Path, device: torch.device) -> LeaderGroup:
    """Starts ranks 1..N-1 and joins them in a process group with this process as rank 0."""
    world = cfg.tensor_parallel_size
    if dist.is_initialized():
        raise RankStartError("a process runs one tensor-parallel engine at a time (this one already has a "
                             "torch.distributed process group)")
    for r in range(1, world):
        rank_device(cfg, r, device)  # a clear error before anything starts
    port = _free_port()
    ctx = mp.get_context("spawn")
    hello = ctx.Queue()
    settings = cfg.model_copy(update={"model": str(model_dir)}).model_dump()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, settings, str(device), hello), daemon=True,
                         name=f"tieredkv-rank-{r}") for r in range(1, world)]
    for p in procs:
        p.start()
    try:
        _wait_for_hellos(procs, hello)
        hello.close()
        hello.join_thread()
        dist.init_process_group(_backend(device), init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=world,
                                timeout=GROUP_TIMEOUT)
    except BaseException as e:
        for p in procs:
            p.kill()
        if isinstance(e, RankStartError):
            raise
        raise RankStartError(f"the tensor-parallel process group did not form on port {port}: {e}") from e
    return LeaderGroup(Shard(0, world), device, procs)


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_hellos(procs: list, hello) -> None:
    """Each rank says it started (or why it could not) before the group forms; one that dies first is an error."""
    pending, deadline = {int(p.name.rsplit("-", 1)[1]) for p in procs}, time.monotonic() + START_TIMEOUT_S
    while pending:
        try:
            rank, error = hello.get(timeout=0.2)
        except queue.Empty:
            dead = [p for p in procs if not p.is_alive()]
            if dead:
                raise RankStartError(
                    f"tensor-parallel rank process {dead[0].name} exited with code {dead[0].exitcode} while starting "
                    "(its error is on stderr; a script that starts the engine at import needs an `if __name__ == "
                    '"__main__":` guard, as every program using multiprocessing\'s spawn does)') from None
            if time.monotonic() > deadline:
                raise RankStartError(f"tensor-parallel ranks {sorted(pending)} did not start within "
                                     f"{START_TIMEOUT_S:.0f} s") from None
            continue
        if error is not None:
            raise RankStartError(f"tensor-parallel rank {rank} could not start: {error}")
        pending.discard(rank)


def rank_main(rank: int, world: int, port: int, settings: dict, leader_device: str, hello) -> None:
    """A rank process: start, join the group, load its share, then carry out rank 0's commands until close."""
    try:
        from tieredkv.engine.rank_build import prepare_rank

        cfg = EngineConfig.model_validate(settings)
        device = rank_device(cfg, rank, torch.device(leader_device))
        prepare_rank(cfg, device)
    except BaseException as e:
        hello.put((rank, f"{type(e).__name__}: {e}"))
        return
    hello.put((rank, None))
    dist.init_process_group(_backend(device), init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=GROUP_TIMEOUT)
    try:
        Follower(cfg, TPGroup(Shard(rank, world), device), device).serve()
    except TieredKVError:  # rank 0 is gone, or told us to stop after a failure there
        pass
    finally:
        _leave_group()
    hello.close()
    hello.join_thread()  # (its one message went long ago: rank 0 formed the group after reading it)
    exit_without_teardown(0)  # rank 0's close waits on this exit


class Follower:
    """Ranks 1..N-1: the same model runner over this rank's share, driven by rank 0's step messages."""

    def __init__(self, cfg: EngineConfig, tp: TPGroup, device: torch.device):
        from tieredkv.engine.rank_build import load_share, rank_runner, shift_keys

        self.tp, self.cfg = tp, cfg
        self.model, self.ops, _ = load_share(cfg, Path(cfg.model), device, tp)  # the steps rank 0 takes too
        shift_keys(cfg, self.model, device, tp)
        self.runner, self.io = rank_runner(cfg, self.model, self.ops, tp.broadcast(), device, tp)
        from tieredkv.engine.adapters import Adapters
        from tieredkv.engine.resolve import resolve_dtype
        from tieredkv.models.spec import ModelSpec

        whole = ModelSpec.from_file(Path(cfg.model) / "config.json")
        self.adapters = Adapters(whole, resolve_dtype(cfg.dtype, device), device, None, cfg.max_loras,
                                 cfg.max_lora_rank, tp.shard)
        self.runner.lora_stack = self.adapters.stack
        tp.gather_objects(None)  # ready

    def serve(self) -> None:
        while True:
            message = self.tp.broadcast()
            if message[0] == "close":
                return
            _, ops, control, warmup, rows = message
            for _, op, name, *path in control:  # rank 0 registered (having checked it) or unregistered an adapter
                if op == "register":
                    self.adapters.register(name, path[0])
                else:
                    self.adapters.unregister(name)
            self.io.run(ops)
            if warmup:
                self.runner.warmup()
            if rows is not None:
                self.runner.forward_rows(rebuild(rows, self.adapters.acquire))
