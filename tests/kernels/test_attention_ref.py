"""The torch decode attention (the CPU path) against attention written out per sequence."""

import random

import pytest
import torch

from helpers import naive_decode
from tieredkv.kernels.decode_attention import decode_attention_ref, length_groups


def test_length_groups_cover_the_batch_once_in_length_order():
    rng = random.Random(0)
    for _ in range(50):
        lens = tuple(rng.randint(1, 700) for _ in range(rng.randint(1, 40)))
        groups = length_groups(lens, 16)
        flat = [i for g in groups for i in g]
        assert sorted(flat) == list(range(len(lens)))
        assert [lens[i] for i in flat] == sorted(lens)
    assert len(length_groups((300,) * 8, 16)) == 1  # one length: one call
    assert len(length_groups((20, 21, 30, 2000, 2010), 16)) == 2  # far apart: split
    assert len(length_groups((700, 5, 64, 65, 333, 16, 17, 690, 1, 250), 16)) > 1


@pytest.mark.parametrize("lens", [
    [700, 5, 64, 65, 333, 16, 17, 690, 1, 250],  # unsorted, widely spread: several groups
    [37, 5, 64],  # unsorted, one group
    [3, 40, 41, 41],  # sorted, one group
    [9],
])
def test_decode_attention_matches_per_sequence_attention(lens):
    g = torch.Generator().manual_seed(len(lens))
    bs, hkv, group, d = 16, 2, 3, 32
    nb = [-(-n // bs) for n in lens]
    num_blocks = sum(nb) + 3
    kc = torch.randn(num_blocks, bs, hkv, d, generator=g)
    vc = torch.randn(num_blocks, bs, hkv, d, generator=g)
    ids = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(lens), max(nb), dtype=torch.int32)
    used = 0
    for b, n in enumerate(nb):
        tables[b, :n] = torch.tensor(ids[used : used + n])
        used += n
    q = torch.randn(len(lens), hkv * group, d, generator=g)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    want = naive_decode(q, kc, vc, tables, lens, d**-0.5)
    for _ in range(2):  # the second call reuses the step's plan, as the model's later layers do
        got = decode_attention_ref(q, kc, vc, tables, context_lens, d**-0.5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # new tensors with other contents get a new plan, never the last one
    got = decode_attention_ref(q.flip(0), kc, vc, tables.flip(0), context_lens.flip(0), d**-0.5)
    torch.testing.assert_close(got, want.flip(0), rtol=1e-5, atol=1e-5)
