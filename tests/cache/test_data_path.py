"""The data path without a model: the KV manager and scheduler plan block moves as data, in a safe order,
and the tier manager carries them out (a fake forward writes the blocks)."""

import contextlib
from types import SimpleNamespace

import pytest
import torch

from helpers import make_config
from tieredkv.config import SamplingParams
from tieredkv.core.sequence import Request, Sequence, SeqStatus
from tieredkv.core.far_blocks import FAR_POLICY, Room
from tieredkv.engine.build import build_cache_core
from tieredkv.kernels.dispatch import TORCH_OPS
from tieredkv.runner.far_stage import stage_groups
from tieredkv.tiers.moves import COPY, DEMOTE, OFFLOAD, PROMOTE, SWAP_OUT

BS, LAYERS, HEADS, DIM = 4, 2, 1, 2


def make(num_blocks=8, warm_blocks=8, budget=64, max_seqs=8, lower=None, device="cpu", far=False, mode=None):
    """A pool, KV manager, cache, tier manager (warm, then `lower` in cold's place) and scheduler, as the engine
    builds them (build.build_cache_core) over a cache tensor of its own. With `far`, the warm slab is the cache
    tensor's tail and the pool lends its slots as far blocks (in place, as on CPU); `mode="staged"` lends them from
    a slab of its own (as on CUDA)."""
    policy = FAR_POLICY[mode or ("in_place" if far else "off")]
    cache = torch.zeros(LAYERS, 2, num_blocks + policy.tail(warm_blocks), BS, HEADS, DIM,
                        device=device)
    cfg = make_config(model="unused", block_size=BS, max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                      scheduling_policy="fcfs")
    spec = SimpleNamespace(num_layers=LAYERS, num_kv_heads=HEADS)
    tiers, kv, _, sched = build_cache_core(cfg, spec, num_blocks, cache, TORCH_OPS, "test", warm_blocks,
                                           policy, cold=lower)
    return tiers.hot.pool, kv, cache, tiers, sched


def cache_then_evict(sched, tiers, cache, kv, prompt, other):
    """Runs `prompt` (its full blocks get cached), then `other`, whose allocation evicts them; returns
    the first three blocks' values as `prompt` computed them, and the evicting step's output."""
    first = seq(prompt)
    sched.add(first)
    run_step(sched, tiers, cache, kv)
    expected = block_values(cache, first)[:3]
    sched.finish(first, "stop")
    evictor = seq(other, "other")
    sched.add(evictor)
    out = run_step(sched, tiers, cache, kv)
    sched.finish(evictor, "stop")
    return expected, out


def seq(tokens, rid="r"):
    req = Request(rid, list(tokens), SamplingParams(max_tokens=8), frozenset())
    s = Sequence(req, 0, list(tokens), None)
    req.seqs.append(s)
    return s


def fake_forward(cache, scheduled, advance=True):
    """Writes each computed token's value (its token id) into its slot, as the forward would; with `advance`, counts
    the tokens computed (the engine's lifecycle counts them itself)."""
    for s, n in scheduled:
        for p in range(s.num_computed_tokens, s.num_computed_tokens + n):
            cache[:, :, s.block_table[p // BS].block_id, p % BS] = float(s.token_ids[p])
        if advance:
            s.num_computed_tokens += n


def block_values(cache, s):
    return [cache[0, 0, b.block_id, :, 0, 0].tolist() for b in s.block_table]


def run_step(sched, tiers, cache, kv, watch=None):
    """One step: plan (inside `watch`, a TorchDispatchMode, when given), carry the moves out, a fake forward."""
    with watch if watch is not None else contextlib.nullcontext():
        out = sched.schedule()
    tiers.execute(out.moves)
    fake_forward(cache, out.scheduled)
    for s, _ in out.scheduled:
        kv.cache_full_blocks(s)
    return out


def test_budget_chunks_prefills_and_decodes_go_first():
    pool, kv, cache, tiers, sched = make(num_blocks=16, budget=8)
    a, b = seq(range(10, 22), "a"), seq(range(30, 35), "b")
    sched.add(a)
    sched.add(b)
    out = run_step(sched, tiers, cache, kv)
    assert [(s.request.request_id, n) for s, n in out.scheduled] == [("a", 8)]
    out = run_step(sched, tiers, cache, kv)
    assert [(s.request.request_id, n) for s, n in out.scheduled] == [("a", 4), ("b", 4)]
    a.token_ids.append(99)  # a decodes now; it is served before b's prefill continues
    out = run_step(sched, tiers, cache, kv)
    assert [(s.request.request_id, n) for s, n in out.scheduled] == [("a", 1), ("b", 1)]


def test_an_evicted_cached_block_is_demoted_before_it_is_reused_and_promoted_back_intact():
    pool, kv, cache, tiers, sched = make(num_blocks=4)
    # 3 full blocks + 1 token, then a prompt that needs all 4 blocks: every cached one is evicted
    expected, out = cache_then_evict(sched, tiers, cache, kv, range(10, 23), range(50, 63))
    kinds = [m.kind for m in out.moves]
    assert kinds == [DEMOTE] * 3, kinds  # planned when allocated, carried out before the forward wrote
    assert tiers.warm.contains_sync(kv.chain_keys(list(range(10, 22)))) == 3
    again = seq(range(10, 23), "again")
    sched.add(again)
    for _ in range(3):
        out = run_step(sched, tiers, cache, kv)
        if out.scheduled:
            break
    assert [m.kind for m in out.moves].count(PROMOTE) == 3
    assert block_values(cache, again)[:3] == expected
    assert again.request.cached_tokens_by_tier == {"hot": 0, "warm": 12}
    assert tiers.warm.stats().promotions == 3 and tiers.hot.stats().evictions >= 3


def test_copy_on_write_is_a_planned_copy():
    pool, kv, cache, tiers, sched = make(num_blocks=8)
    parent = seq(range(10, 16))  # 1 full block + a shared partial one
    sched.add(parent)
    run_step(sched, tiers, cache, kv)
    child = Sequence(parent.request, 1, list(parent.token_ids), None)
    kv.fork(parent, child)
    sched.add_running(child)
    shared = child.block_table[1].block_id
    parent.token_ids.append(1)
    child.token_ids.append(2)
    out = run_step(sched, tiers, cache, kv)
    copies = [m for m in out.moves if m.kind == COPY]
    assert len(copies) == 1 and copies[0].src == shared
    assert block_values(cache, parent)[1][:3] == [14.0, 15.0, 1.0]
    assert block_values(cache, child)[1][:3] == [14.0, 15.0, 2.0]


def test_preemption_swaps_the_newest_out_first_and_back_in_intact():
    pool, kv, cache, tiers, sched = make(num_blocks=6, warm_blocks=16, budget=64)
    old, new = seq(range(10, 19), "old"), seq(range(30, 39), "new")  # 3 blocks each
    sched.add(old)
    sched.add(new)
    run_step(sched, tiers, cache, kv)
    saved = block_values(cache, new)
    old.token_ids.extend([1] * 4)  # old needs a 4th block: the newest running sequence goes
    out = run_step(sched, tiers, cache, kv)
    assert [s.request.request_id for s in out.preempted] == ["new"]
    assert [m.kind for m in out.moves][:3] == [SWAP_OUT] * 3
    lent = [m.dst for m in out.moves[:3]]
    assert new.status is SeqStatus.WAITING and new.swapped is not None
    sched.finish(old, "stop")
    out = run_step(sched, tiers, cache, kv)
    # back as a promotion from the slots lent to it, in order, with no key (the sequence's own blocks, not a prefix
    # found below: nothing is registered for them)
    back = [m for m in out.moves if m.kind == PROMOTE]
    assert [(m.src, m.tier, m.key) for m in back] == [(slot, "warm", None) for slot in lent]
    assert [m.dst for m in back] == [b.block_id for b in new.block_table[:3]]
    assert block_values(cache, new) == saved
    sched.finish(new, "stop")
    assert len(tiers.warm.free_slots) + len(tiers.warm.entries) == tiers.warm.capacity
    assert pool.num_free == pool.num_blocks


@pytest.mark.parametrize("mode", ["in_place", "staged", "off"])
def test_each_far_mode_makes_room_before_or_instead_of_preempting_as_its_policy_says(mode):
    """A dry pool, planned under each far mode's room (core/far_blocks.py): read in place, old blocks of any running
    sequence move below hot before anyone is preempted; staged, the newest sequence is preempted (swapped) first, and
    a sequence that cannot fit even alone moves its own old blocks down; off, preemption is all there is."""
    pool, kv, cache, tiers, sched = make(num_blocks=6, warm_blocks=16, budget=64, mode=mode)
    old, new = seq(range(10, 19), "old"), seq(range(30, 39), "new")  # 3 blocks each: the whole pool
    sched.add(old)
    sched.add(new)
    run_step(sched, tiers, cache, kv)
    old.token_ids.extend([1] * 4)  # old needs a 4th block
    out = run_step(sched, tiers, cache, kv)
    kinds = [m.kind for m in out.moves]
    if mode == "in_place":  # old's oldest block (the first of the lowest position) goes down; nobody is preempted
        assert kinds == [OFFLOAD] and not out.preempted and old.block_table[0].block_id == pool.far_base
        assert sched.room.offloaded_blocks == 1 and not sched.room.swappable(old) and sched.room.swappable(new)
        return
    assert [s.request.request_id for s in out.preempted] == ["new"] and kinds == [SWAP_OUT] * 3
    assert new.swapped is not None and sched.room.offloaded_blocks == 0
    old.token_ids.extend([2] * 12)  # 25 tokens: 7 blocks on a pool of 6, with nobody else to preempt
    out = run_step(sched, tiers, cache, kv)
    kinds = [m.kind for m in out.moves]
    if mode == "staged":  # its own old blocks go down: it keeps running
        assert OFFLOAD in kinds and not out.preempted and (old, 12) in out.scheduled
        assert pool.is_far(old.block_table[0]) and sched.room.offloaded_blocks == kinds.count(OFFLOAD)
    else:  # it is its own victim
        assert [s.request.request_id for s in out.preempted] == ["old"] and OFFLOAD not in kinds
    sched.finish(old, "stop")
    sched.finish(new, "stop")
    assert pool.num_free == pool.num_blocks and pool.num_far == 0


def test_free_releases_blocks_tail_first_and_empty_ones_to_be_reused_first():
    """The cached blocks go to the queue's tail, the chain's tail first (evicted before its head); the partial last
    block, which nobody can find, to the head: the next allocation takes it before evicting anything cached."""
    pool, kv, cache, tiers, sched = make(num_blocks=8)
    s = seq(range(10, 23))  # 3 full blocks and 1 token
    sched.add(s)
    run_step(sched, tiers, cache, kv)
    ids = [b.block_id for b in s.block_table]
    kv.free(s)
    queue = [b.block_id for b in pool.free_queue]
    assert queue[0] == ids[-1] and queue[-3:] == ids[2::-1]
    (fresh,), evicted = pool.allocate(1)
    assert fresh.block_id == ids[-1] and evicted == [] and pool.num_cached_free == 3


def test_a_new_tier_is_one_class_under_the_tier_manager():
    from memory_tier import MemoryTier

    memory = MemoryTier(16, LAYERS * 2 * BS * HEADS * DIM * 4)
    pool, kv, cache, tiers, sched = make(num_blocks=4, warm_blocks=2, lower=memory)
    # the 3 cached blocks are evicted: 2 fit warm, the rest goes on down
    expected, _ = cache_then_evict(sched, tiers, cache, kv, range(10, 23), range(50, 63))
    tiers.clear("warm", demote=True)  # warm -> the new tier
    assert memory.contains_sync(kv.chain_keys(list(range(10, 22)))) == 3
    again = seq(range(10, 23), "again")
    sched.add(again)
    run_step(sched, tiers, cache, kv)
    assert block_values(cache, again)[:3] == expected
    assert again.request.cached_tokens_by_tier == {"hot": 0, "cold": 12}
    assert memory.stats().promotions == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_moves_use_pinned_views_and_a_copy_stream_the_forward_waits_for():
    pool, kv, cache, tiers, sched = make(num_blocks=6, device="cuda")
    warm = tiers.warm
    assert warm.slab.is_pinned() and tiers._copy_stream is not None
    # the cached blocks are evicted into the pinned slab (device to host)
    expected, _ = cache_then_evict(sched, tiers, cache, kv, range(10, 23), range(50, 71))
    for view in (v for _, v in warm.store.read_runs(list(range(3)))):
        assert view.is_pinned() and view.data_ptr() >= warm.slab.data_ptr()  # views, not copies
    again = seq(range(10, 23), "again")
    sched.add(again)
    out = run_step(sched, tiers, cache, kv)  # promoted H2D on the copy stream; the compute stream waits
    assert [m.kind for m in out.moves].count(PROMOTE) == 3
    torch.cuda.current_stream().synchronize()
    assert block_values(cache, again)[:3] == expected
    tiers.execute([])  # settles: the lent slots come back once their copies are done
    assert len(warm.free_slots) + len(warm.entries) == warm.capacity


def _with_memory_tier(memory_cls, num_blocks=4):
    memory = memory_cls(16, LAYERS * 2 * BS * HEADS * DIM * 4)
    return (*make(num_blocks=num_blocks, warm_blocks=0, lower=memory), memory)


def test_a_failing_lower_tier_is_a_miss_and_a_failure_count():
    from memory_tier import MemoryTier

    class Broken(MemoryTier):
        blocking = True  # read in the reader thread, like the disk tier

        def get_sync(self, keys):
            raise OSError("disk gone")

    pool, kv, cache, tiers, sched, memory = _with_memory_tier(Broken)
    prompt = list(range(10, 23))
    memory.put_sync(kv.chain_keys(prompt[:12]), torch.ones(3, LAYERS, 2, BS, HEADS, DIM))
    s = seq(prompt)
    sched.add(s)
    for _ in range(20):
        out = run_step(sched, tiers, cache, kv)
        if out.scheduled:
            break
        tiers.wait([x.lookup for x in out.waiting_on_disk if x.lookup], timeout=1)
    assert out.scheduled == [(s, 13)]  # computed from scratch
    assert s.request.num_cached_tokens == 0
    assert memory.stats().failures == 1


def test_a_finished_lookup_waits_for_room_instead_of_being_read_again():
    from memory_tier import MemoryTier

    reads = []

    class Counting(MemoryTier):
        blocking = True

        def get_sync(self, keys):
            reads.append(keys[0].token_ids[0])
            return super().get_sync(keys)

    pool, kv, cache, tiers, sched, memory = _with_memory_tier(Counting, num_blocks=6)
    prompt = list(range(10, 23))
    memory.put_sync(kv.chain_keys(prompt[:12]), torch.ones(3, LAYERS, 2, BS, HEADS, DIM))
    hog = seq(range(100, 117), "hog")  # 5 blocks: no room for the 4 the prompt needs
    sched.add(hog)
    run_step(sched, tiers, cache, kv)
    s = seq(prompt)
    sched.add(s)
    for _ in range(5):
        out = run_step(sched, tiers, cache, kv)
        tiers.wait([x.lookup for x in out.waiting_on_disk if x.lookup], timeout=1)
        assert s.status is SeqStatus.WAITING
    sched.finish(hog, "stop")
    run_step(sched, tiers, cache, kv)
    assert s.status is SeqStatus.RUNNING and s.request.cached_tokens_by_tier["cold"] == 12
    assert reads.count(10) == 1  # the prompt's blocks were read once, kept while the pool was full


# -- one pool over hot ids and far ids (warm slots lent to running sequences) ---------------------------


def test_one_pool_counts_references_and_hashes_in_both_id_ranges():
    pool, kv, cache, tiers, sched = make(num_blocks=4, warm_blocks=6, far=True)
    warm = tiers.warm
    (hot,), _ = pool.allocate(1)
    slots, victims = warm.lend(2)  # (the KV manager lends far blocks so: warm's slots, a far block over each)
    fars = [pool.far_block(slot) for slot in slots]
    assert [b.block_id for b in fars] == [4, 5] and victims == ([], [])  # far_base + the lowest slots
    assert [pool.is_far(b) for b in (hot, *fars)] == [False, True, True] and pool.num_far == 2
    keys = kv.chain_keys(list(range(3 * BS)))
    for block, key in zip((hot, *fars), keys):
        pool.cache(block, *key)
    assert pool.cached_prefix(keys) == [hot, *fars]  # one hash map over both ranges
    assert pool.cached_prefix(keys, hot_only=True) == [hot]
    assert [pool.tier_of(b) for b in pool.cached_prefix(keys)] == ["hot", "warm", "warm"]
    pool.touch([fars[0]])
    pool.free([fars[0]])
    assert fars[0].ref_cnt == 1 and pool.num_far == 2
    pool.free(reversed([hot, *fars]))  # tail first: a far block's last reference returns its slot
    assert pool.num_far == 0 and pool.num_free == 4
    assert pool.cached_prefix(keys) == [hot]  # the far ones are warm entries now, in LRU order
    assert [s for s, _ in warm.entries.values()] == [1, 0] and warm.contains_sync(keys[1:]) == 2
    plain = pool.far_block(warm.lend(1)[0][0])  # a far block without a hash goes back as a free slot
    pool.free([plain])
    assert len(warm.free_slots) + len(warm.entries) == warm.capacity


def test_offload_is_a_move_of_its_own_and_the_sequence_reads_its_old_blocks_in_place():
    pool, kv, cache, tiers, sched = make(num_blocks=4, warm_blocks=8, budget=64, far=True)
    a = seq(range(10, 23), "a")  # 3 full blocks + 1 token: all 4 hot blocks
    sched.add(a)
    run_step(sched, tiers, cache, kv)
    before = block_values(cache, a)
    a.token_ids.extend(range(60, 64))  # a 5th block: its oldest full block goes to a far block
    out = run_step(sched, tiers, cache, kv)
    assert [(m.kind, m.src, m.dst) for m in out.moves] == [(OFFLOAD, 0, pool.far_base)] and not out.preempted
    assert a.block_table[0].block_id == pool.far_base and pool.num_far == 1 and sched.room.offloaded_blocks == 1
    assert block_values(cache, a)[:3] == before[:3]  # the data moved with the block
    keys = kv.chain_keys(a.token_ids)
    assert pool.cached_prefix(keys)[:3] == a.block_table[:3]  # its hash moved too
    assert tiers.warm.stats().demotions == 1
    sched.finish(a, "stop")
    assert pool.num_far == 0 and tiers.warm.contains_sync(keys) == 1


def test_a_prefix_too_big_for_hot_is_adopted_as_far_blocks_with_planned_promotions():
    from memory_tier import MemoryTier

    memory = MemoryTier(16, LAYERS * 2 * BS * HEADS * DIM * 4)  # stands in for cold
    pool, kv, cache, tiers, sched = make(num_blocks=4, warm_blocks=8, budget=64, far=True, lower=memory)
    prompt = list(range(10, 10 + 6 * BS + 1))  # 6 full blocks + 1 token: more than hot holds
    keys = kv.chain_keys(prompt)
    data = torch.arange(6, dtype=torch.float32)[:, None, None, None, None, None].expand(6, LAYERS, 2, BS, HEADS, DIM)
    memory.put_sync(keys, data.clone())
    s = seq(prompt)
    sched.add(s)
    out = run_step(sched, tiers, cache, kv)
    promotions = [m for m in out.moves if m.kind == PROMOTE]
    assert [m.dst for m in promotions] == [pool.far_base + i for i in range(6)] and not tiers.warm.entries
    assert all(pool.is_far(b) for b in s.block_table[:6]) and s.request.cached_tokens_by_tier["cold"] == 6 * BS
    assert [v[0] for v in block_values(cache, s)[:6]] == [float(i) for i in range(6)]  # landed in warm slots
    assert memory.stats().promotions == 6
    sched.finish(s, "stop")
    assert pool.num_far == 0 and tiers.warm.contains_sync(keys) == 6


def test_a_step_is_staged_in_groups_whose_far_blocks_fit_the_cap():
    """The runner's staging budget (far_stage.stage_groups): every scheduled sequence runs, in groups whose
    far blocks fit the cap; near ones ride in the first; one over the cap is a group of its own."""
    far = {"n1": 0, "a": 3, "b": 3, "n2": 0, "c": 2, "big": 9, "d": 1}
    step = [(name, 1) for name in far]
    groups = stage_groups(step, far.get, 5)
    assert [[name for name, _ in g] for g in groups] == [["n1", "n2", "a"], ["b", "c"], ["big"], ["d"]]
    assert sorted(name for g in groups for name, _ in g) == sorted(far)  # each once, none left for later
    assert all(sum(far[name] for name, _ in g) <= 5 for g in groups if len(g) > 1)
    assert stage_groups([("x", 4), ("y", 1)], {"x": 0, "y": 0}.get, 5) == [[("x", 4), ("y", 1)]]
    assert stage_groups([], far.get, 5) == []


class _TensorOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Every tensor operation run inside it, by name (reads, copies, creations alike)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("far", [False, True])
def test_planning_touches_no_tensor_and_warm_evictions_go_down_as_moves(far):
    """A workload that demotes hot blocks into a full warm tier, then swaps a preempted sequence out (or, with far
    blocks, offloads old blocks) into slots whose cached entries must make room: no tensor operation runs while any
    step is planned, the evicted entries go down to cold only as PASS_DOWN moves planned before the moves that
    write their slots, and cold holds exactly the data they had."""
    from memory_tier import MemoryTier

    from tieredkv.tiers.moves import PASS_DOWN

    cold = MemoryTier(64, LAYERS * 2 * BS * HEADS * DIM * 4)
    pool, kv, cache, tiers, sched = make(num_blocks=6, warm_blocks=8, budget=64, lower=cold, far=far)
    planned = []

    def step():
        seen = _TensorOps()
        out = run_step(sched, tiers, cache, kv, watch=seen)
        assert seen.ops == [], seen.ops[:10]
        planned.append([m.kind for m in out.moves])
        return out

    for i in range(7):  # 2 full blocks each, cached: hot keeps the newest, warm fills with the rest
        s = seq(range(100 + 10 * i, 109 + 10 * i), f"fill{i}")
        sched.add(s)
        step()
        sched.finish(s, "stop")
    assert len(tiers.warm.entries) == tiers.warm.capacity and any(DEMOTE in kinds for kinds in planned)
    old, new = seq(range(10, 19), "old"), seq(range(30, 39), "new")  # 3 blocks each: the whole pool
    sched.add(old)
    sched.add(new)
    step()
    old.token_ids.extend(range(40, 48))  # old needs two more blocks
    out = step()
    kinds = [m.kind for m in out.moves]
    writer = OFFLOAD if far else SWAP_OUT
    assert writer in kinds and PASS_DOWN in kinds
    assert max(i for i, k in enumerate(kinds) if k == PASS_DOWN) < kinds.index(writer)
    assert (new.swapped is not None) is (not far) and (sched.room.offloaded_blocks > 0) is far
    passed = [m for m in out.moves if m.kind == PASS_DOWN]
    for m in passed:  # what was in the slot when the step was planned reached cold, not what was written after
        got = cold.get_sync([m.key])
        assert got is not None and got[0, 0, 0, :, 0, 0].tolist() == [float(t) for t in m.key.token_ids]
    while sched.running or sched.waiting:
        for s in list(sched.running):
            if s.num_computed_tokens >= len(s.token_ids):
                sched.finish(s, "stop")
        step()
    assert pool.num_free == pool.num_blocks and pool.num_far == 0


def test_a_tier_of_ones_own_stands_in_cold_s_place_but_never_beside_a_cold_path(tmp_path):
    from memory_tier import MemoryTier

    memory = MemoryTier(4, LAYERS * 2 * BS * HEADS * DIM * 4)
    _, _, _, tiers, _ = make(num_blocks=4, warm_blocks=2, lower=memory)
    assert tiers.lower == [tiers.warm, memory]
    cfg = make_config(model="unused", block_size=BS, cold_path=str(tmp_path / "cold"))
    with pytest.raises(ValueError, match="one of them"):
        build_cache_core(cfg, SimpleNamespace(num_layers=LAYERS, num_kv_heads=HEADS), 4,
                         torch.zeros(LAYERS, 2, 4, BS, HEADS, DIM), TORCH_OPS, "test", 0, Room, cold=memory)
    assert not (tmp_path / "cold").exists()  # refused before anything was opened


def test_the_far_policy_follows_the_offload_setting_and_the_device():
    from tieredkv.core.far_blocks import FarInPlace, FarStaged, far_policy

    assert [far_policy(o, "cpu", 8) for o in ("auto", "in_place", "staged", "off")] == \
        [FarInPlace, FarInPlace, FarStaged, Room]
    assert [far_policy(o, "cuda", 8) for o in ("auto", "in_place", "staged", "off")] == \
        [FarStaged, FarStaged, FarStaged, Room]  # pinned host memory: never read in place
    assert far_policy("auto", "cpu", 0) is Room  # no warm block to lend
