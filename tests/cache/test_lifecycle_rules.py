"""What happens to requests after a forward (engine/lifecycle.py), without a model: the scheduler, KV manager and
pool of test_data_path.py, a tokenizer trained on the spot, and logits written by the test so that each sample
"chooses" the tokens of its script. Stop tokens, stop strings, min/max tokens, parallel samples sharing their
prompt's blocks, a row that cannot be sampled, an abort: each checked on the outputs and on the pool."""

from types import SimpleNamespace

import pytest
import torch

from helpers import make_config, make_tokenizer
from test_data_path import fake_forward, make
from tieredkv.config import SamplingParams
from tieredkv.core.pins import PinTable
from tieredkv.engine.lifecycle import Lifecycle
from tieredkv.engine.outputs import StreamChunk
from tieredkv.engine.request_factory import RequestFactory
from tieredkv.engine.telemetry import Telemetry
from tieredkv.errors import SamplingError
from tieredkv.models.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(folder)
    return Tokenizer(folder)


class World:
    """A lifecycle over the model-free data path; `script[(request id, sample)]` is what each sample's logits make
    it choose, token after token (a greedy pick of a row that is 0 but at that token, and at `fallback`, second)."""

    def __init__(self, tokenizer, num_blocks=16):
        self.pool, self.kv, self.cache, self.tiers, self.sched = make(num_blocks=num_blocks, warm_blocks=0)
        vocab = len(tokenizer.hf)
        spec = SimpleNamespace(vocab_size=vocab)
        cfg = make_config(model="unused", block_size=4, max_num_seqs=8)
        self.factory = RequestFactory(tokenizer, spec, cfg, 512, frozenset({tokenizer.hf.eos_token_id}), num_blocks)
        pins = PinTable(self.sched.index, budget=0)
        self.life = Lifecycle(self.sched, self.kv, self.factory, tokenizer, pins, Telemetry(silent=True),
                              torch.device("cpu"), 512)
        self.vocab, self.script, self.chunks, self.errors = vocab, {}, {}, {}
        self.fallback = words(tokenizer, "x")[0]  # what a sample takes where its choice is masked (min_tokens)

    def add(self, prompt, params, rid, *choices):
        req = self.factory.make(prompt, params, rid)
        req.sink = rid  # what the outputs are addressed to (the async front's stream; opaque to the core)
        for i, tokens in enumerate(choices):
            self.script[(rid, i)] = list(tokens)
        self.collect(self.life.add(req))
        return req

    def collect(self, outputs):
        for sink, item in outputs:
            if isinstance(item, StreamChunk):
                assert sink == item.request_id
                self.chunks.setdefault((item.request_id, item.index), []).append(item)
            else:
                self.errors.setdefault(sink, []).append(item)

    def step(self, poison=()):
        out = self.sched.schedule()
        self.tiers.execute(out.moves)
        sampled = [s for s, n in out.scheduled if s.num_computed_tokens + n >= s.num_tokens]
        fake_forward(self.cache, out.scheduled, advance=False)  # the lifecycle counts what the step computed
        logits = torch.zeros(len(sampled), self.vocab)
        for row, s in enumerate(sampled):
            if s.request.request_id in poison:
                logits[row] = float("nan")
            else:
                # a fork samples from its parent's row: every sample of a request reads sample 0's script there,
                # then its own
                script = self.script[(s.request.request_id, s.index)]
                logits[row, self.fallback] = 20.0
                logits[row, script[min(s.num_output_tokens, len(script) - 1)]] = 30.0
        self.collect(self.life.update(out, logits, sampled))
        return out

    def run(self, limit=100, **kw):
        for _ in range(limit):
            if not self.sched.running and not self.sched.waiting:
                return
            self.step(**kw)
        raise AssertionError("the requests never ended")

    def sample(self, rid, index=0):
        chunks = self.chunks[(rid, index)]
        assert all(c.finish_reason is None for c in chunks[:-1])
        return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks), chunks[-1].finish_reason

    def clean(self):
        assert not self.life.requests and self.pool.num_free == self.pool.num_blocks
        assert all(b.ref_cnt == 0 for b in self.pool.blocks)


def words(tokenizer, text):
    return tokenizer.hf.encode(text, add_special_tokens=False)


def test_stop_tokens_lengths_and_min_tokens(tokenizer):
    w = World(tokenizer)
    eos = tokenizer.hf.eos_token_id
    a, b = words(tokenizer, "The quick brown fox"), words(tokenizer, "jumps over the lazy dog")
    prompt = words(tokenizer, "A prefix cache serves shared system prompts once.")
    w.add(prompt, SamplingParams(max_tokens=50), "eos", a + [eos] + b)
    w.add(prompt, SamplingParams(max_tokens=3), "length", a + b)
    w.add(prompt, SamplingParams(max_tokens=50, min_tokens=len(a) + 2), "min", a + [eos, b[0], eos] + b)
    w.add(prompt, SamplingParams(max_tokens=50, stop_token_ids=[b[1]]), "stop id", b + a)
    w.add(prompt, SamplingParams(max_tokens=50, ignore_eos=True), "ignore", a + [eos] + b[:2] + [eos])
    w.run()
    assert w.sample("eos") == (a + [eos], tokenizer.hf.decode(a), "stop")
    assert w.sample("length")[0] == a[:3] and w.sample("length")[2] == "length"
    # before min_tokens a stop token cannot be chosen: the row's next best is
    tokens, _, reason = w.sample("min")
    assert tokens == a + [w.fallback, b[0], eos] and reason == "stop"
    assert w.sample("stop id")[0] == b[:2] and w.sample("stop id")[2] == "stop"
    tokens, _, reason = w.sample("ignore")
    assert reason == "length" and tokens == (a + [eos] + b[:2] + [eos] * 50)[:50]
    w.clean()


def test_a_stop_string_cuts_the_text_and_never_streams_it(tokenizer):
    w = World(tokenizer)
    before, after = words(tokenizer, "Paged attention keeps"), words(tokenizer, " keys and values in blocks")
    eos = tokenizer.hf.eos_token_id
    prompt = words(tokenizer, "Numbers 0123456789")
    w.add(prompt, SamplingParams(max_tokens=40, stop=["and val"]), "s", before + after)
    # a stop string completed before min_tokens does not count
    w.add(prompt, SamplingParams(max_tokens=40, stop=["and val"], min_tokens=len(before + after)), "late",
          before + after + [eos])
    w.run()
    tokens, text, reason = w.sample("s")
    assert reason == "stop" and text == tokenizer.hf.decode(before + after).split("and val")[0]
    assert "and val" not in "".join(c.text for c in w.chunks[("s", 0)])
    assert tokens == (before + after)[: len(tokens)] and len(tokens) < len(before + after)
    tokens, text, reason = w.sample("late")
    assert tokens == before + after + [eos] and reason == "stop" and "and val" in text
    w.clean()


def test_parallel_samples_share_the_prompt_blocks_and_end_on_their_own(tokenizer):
    w = World(tokenizer, num_blocks=24)
    eos = tokenizer.hf.eos_token_id
    prompt = words(tokenizer, "The quick brown fox jumps over the lazy dog. Paged attention")  # several blocks
    first = words(tokenizer, "keeps")[0]
    ones = [first] + words(tokenizer, " keys in blocks") + [eos]
    twos = [first] + words(tokenizer, " values and numbers 0123") + [eos]
    w.add(prompt, SamplingParams(max_tokens=16, n=2), "pair", ones, twos)
    w.step()  # the prompt: sample 0 chooses the first token, sample 1 forks from it with the same row
    seqs = w.life.requests["pair"].seqs
    assert len(seqs) == 2
    full = len(prompt) // 4
    shared = [a is b for a, b in zip(seqs[0].block_table[:full], seqs[1].block_table[:full])]
    assert shared == [True] * full and all(b.ref_cnt == 2 for b in seqs[0].block_table[:full])
    w.run()
    assert w.sample("pair", 0)[0] == ones and w.sample("pair", 1)[0] == twos
    assert w.sample("pair", 0)[2] == w.sample("pair", 1)[2] == "stop"
    # each sample's last chunk counts its own tokens (the async front adds them up)
    assert [w.chunks[("pair", i)][-1].usage.completion_tokens for i in (0, 1)] == [len(ones), len(twos)]
    w.clean()


def test_a_row_that_cannot_be_sampled_fails_its_request_alone(tokenizer):
    w = World(tokenizer)
    a = words(tokenizer, "The quick brown fox jumps")
    prompt = words(tokenizer, "Numbers 0123456789")
    w.add(prompt, SamplingParams(max_tokens=5, ignore_eos=True), "bad", a)
    w.add(prompt, SamplingParams(max_tokens=5, ignore_eos=True), "good", a)
    w.step()
    w.step(poison={"bad"})
    w.run()
    assert [type(e) for e in w.errors.get("bad", [])] == [SamplingError]
    assert w.sample("good")[0] == a[:5] and w.sample("good")[2] == "length"
    w.clean()


def test_an_abort_ends_the_request_and_frees_its_blocks(tokenizer):
    w = World(tokenizer)
    a = words(tokenizer, "The quick brown fox jumps over the lazy dog")
    w.add(words(tokenizer, "Numbers 0123456789 and symbols"), SamplingParams(max_tokens=40, ignore_eos=True), "x", a)
    w.step()
    w.step()
    assert w.pool.num_free < w.pool.num_blocks
    w.collect(w.life.abort("x"))
    assert w.chunks[("x", 0)][-1].finish_reason == "abort"
    assert not w.sched.running and not w.sched.waiting
    w.clean()


@pytest.mark.parametrize("mode", ["off", "in_place", "staged"])
def test_a_request_fits_hot_and_the_blocks_its_far_policy_lends(tokenizer, mode):
    """The factory's precheck asks the far-block policy: off, a request's every block must be hot; with far blocks
    (either mode) warm's blocks count too, but each sample's last block and one more must be hot at once."""
    from tieredkv.core.far_blocks import FAR_POLICY
    from tieredkv.errors import RequestError

    cfg = make_config(model="unused", block_size=4, max_num_seqs=8)
    spec = SimpleNamespace(vocab_size=len(tokenizer.hf))
    factory = RequestFactory(tokenizer, spec, cfg, 512, frozenset(), 6, 10, FAR_POLICY[mode])
    far = mode != "off"

    def fits(prompt, max_tokens, n=1, pinned=0):
        try:
            factory.check_fits(prompt, SamplingParams(max_tokens=max_tokens, n=n), pinned)
            return True
        except RequestError as e:
            assert ("in the pool at once" in str(e)) == (far and prompt + max_tokens <= 4 * 16), str(e)
            return False

    assert fits(20, 4)  # 6 blocks: the pool's
    assert fits(20, 5) == far  # 7 blocks: one in warm
    assert fits(60, 4) == far and not fits(60, 5)  # 16: the pool's and warm's, then one more
    assert fits(20, 4, pinned=1) == far  # 6 blocks beside a pinned one
    assert fits(2, 2, n=6) and not fits(2, 2, n=7)  # six one-block samples fit hot either way, seven do not
    assert fits(2, 4, n=5) == far  # five two-block samples: 10 blocks, 6 of them hot at once
    assert not fits(2, 4, n=6)  # 12 blocks, 7 of them hot at once
