"""Beam search's rules (core/beam.py) without a model: a made-up language model whose log-probabilities depend only
on the tokens so far, driven as engine/lifecycle.py drives a request's beams. A search wide enough to keep every
candidate must return exactly the best finished sequences of an exhaustive enumeration; a narrow one must follow
early_stopping and the length limit; an aborted one is made up with its running beams."""

import itertools

import pytest
import torch

from tieredkv.config import SamplingParams
from tieredkv.core.beam import BeamSearch, penalized

VOCAB, STOP = 4, 3


class Detok:
    """Stands in for IncrementalDetokenizer: the search forks one and adds a token when a beam finishes."""

    def __init__(self, ids=()):
        self.ids = list(ids)

    def fork(self):
        return Detok(self.ids)

    def add(self, token, check_stop=True):
        self.ids.append(token)
        return False


class FakeBeam:
    def __init__(self, tokens, logprob):
        self.output_token_ids, self.beam_logprob, self.detokenizer = list(tokens), logprob, Detok(tokens)

    @property
    def num_output_tokens(self):
        return len(self.output_token_ids)


def language_model(seed: int, favour_stop: float = 0.0):
    """tokens so far -> a row of log-probabilities over VOCAB, fixed per prefix (and seed)."""
    def row(tokens):
        g = torch.Generator().manual_seed(hash((seed, tuple(tokens))) % (2**31))
        logits = torch.randn(VOCAB, generator=g) * 2
        logits[STOP] += favour_stop
        return logits.log_softmax(-1)
    return row


def run_search(params: SamplingParams, lm, max_steps: int = 100):
    search = BeamSearch(params, frozenset({STOP}), num_prompt_tokens=5, max_model_len=10_000)
    beams = [FakeBeam([], 0.0)]
    for _ in range(max_steps):
        survivors = search.step(beams, torch.stack([lm(b.output_token_ids) for b in beams]))
        if search.done:
            return search, search.results(beams, "length")
        beams = [FakeBeam(s.parent.output_token_ids + [s.token], s.cum_logprob) for s in survivors]
    raise AssertionError("the search never ended")


def exhaustive(lm, max_new: int, length_penalty: float):
    """Every sequence a search can finish (ending in STOP, or max_new long without it), best score first."""
    done = []
    for length in range(1, max_new + 1):
        for tokens in itertools.product(range(VOCAB), repeat=length):
            if STOP in tokens[:-1] or (tokens[-1] != STOP and length < max_new):
                continue
            cum = float(sum(lm(tokens[:i])[t] for i, t in enumerate(tokens)))
            done.append((penalized(cum, length, length_penalty), list(tokens)))
    return sorted(done, key=lambda d: -d[0])


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, -1.0, 2.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_search_wide_enough_for_every_candidate_returns_the_exhaustive_best(seed, length_penalty):
    # 3 new tokens over 4 of them, one a stop: 40 sequences can finish, at most 36 candidates in a step; a width of
    # 36 keeps them all, so the k best finished are the enumeration's best
    lm = language_model(seed)
    n = 8
    params = SamplingParams(max_tokens=3, beam_width=36, n=n, length_penalty=length_penalty)
    search, results = run_search(params, lm)
    want = exhaustive(lm, 3, length_penalty)[:n]
    assert [h.token_ids for h in results] == [tokens for _, tokens in want]
    assert [h.score for h in results] == pytest.approx([score for score, _ in want], rel=1e-5)
    for h in results:
        assert h.finish_reason == ("stop" if h.token_ids[-1] == STOP else "length")
        assert h.detokenizer.ids == h.token_ids  # the finished beam's text saw its last token
        assert h.cum_logprob == pytest.approx(float(sum(lm(h.token_ids[:i])[t] for i, t in enumerate(h.token_ids))),
                                              rel=1e-5)
    assert search.steps == 3


def table_model(first: dict, after: dict):
    """A language model of two rows: `first` for the first token, `after` for every later one (token -> prob)."""
    rows = [torch.tensor([d.get(t, 1e-9) for t in range(VOCAB)]).log() for d in (first, after)]
    return lambda tokens: rows[min(len(tokens), 1)]


def test_a_narrow_search_step_by_step():
    """Width 2: of the first two candidates a stop finishes and the other runs, a third-best beam runs only while
    the two do not fill the width, and a stop candidate past the first two is never offered."""
    lm = table_model({0: 0.45, STOP: 0.4, 1: 0.1, 2: 0.05}, {0: 0.9, STOP: 0.08, 1: 0.01, 2: 0.01})
    search = BeamSearch(SamplingParams(max_tokens=10, beam_width=2, n=2), frozenset({STOP}), 5, 10_000)
    beams = [FakeBeam([], 0.0)]
    seen = []
    for _ in range(2):
        survivors = search.step(beams, torch.stack([lm(b.output_token_ids) for b in beams]))
        beams = [FakeBeam(s.parent.output_token_ids + [s.token], s.cum_logprob) for s in survivors]
        seen.append(([b.output_token_ids for b in beams], [h.token_ids for h in search.finished]))
    assert seen == [([[0], [1]], [[STOP]]),  # [STOP] is second best: it finishes; [1], third, runs
                    ([[0, 0], [1, 0]], [[STOP]])]
    assert beams[1].beam_logprob == pytest.approx(float(torch.tensor([0.1, 0.9]).log().sum()))
    # after 1 a stop is likely: [1, STOP] finishes first, [0, 0] runs, [0, STOP] (third) is not offered though a
    # running place is left, and [1, 0] takes it
    rows = {None: {0: 0.5, 1: 0.4, STOP: 0.05, 2: 0.05}, 0: {0: 0.6, STOP: 0.35, 1: 0.03, 2: 0.02},
            1: {STOP: 0.9, 0: 0.05, 1: 0.03, 2: 0.02}}
    table = {k: torch.tensor([d.get(t, 1e-9) for t in range(VOCAB)]).log() for k, d in rows.items()}
    search = BeamSearch(SamplingParams(max_tokens=10, beam_width=2, n=2), frozenset({STOP}), 5, 10_000)
    beams = [FakeBeam([], 0.0)]
    for _ in range(2):
        survivors = search.step(beams, torch.stack([table[(b.output_token_ids or [None])[-1]] for b in beams]))
        beams = [FakeBeam(s.parent.output_token_ids + [s.token], s.cum_logprob) for s in survivors]
    assert [b.output_token_ids for b in beams] == [[0, 0], [1, 0]]
    assert [h.token_ids for h in search.finished] == [[1, STOP]]


def test_early_stopping_ends_once_width_beams_finished():
    # two hypotheses finish by the second step while the best running beam could still beat them (each 0 costs
    # less than the average of what finished): early_stopping True ends there; False and "never" go on, here to the
    # length limit
    lm = table_model({0: 0.45, STOP: 0.4, 1: 0.1, 2: 0.05}, {0: 0.6, STOP: 0.35, 1: 0.03, 2: 0.02})
    runs = {stop: run_search(SamplingParams(max_tokens=12, beam_width=2, n=2, early_stopping=stop), lm)
            for stop in (True, False, "never")}
    eager, eager_results = runs[True]
    assert eager.steps == 2 and [h.token_ids for h in eager_results] == [[STOP], [0, STOP]]
    assert runs[False][0].steps == runs["never"][0].steps == 12
    for stop in (False, "never"):  # longer hypotheses beat both
        assert [h.token_ids for h in runs[stop][1]] == [[0] * 12, [0] * 11 + [STOP]]  # -0.535 and -0.580 a token


def test_the_length_limit_ends_every_beam_and_scores_rank_the_results():
    lm = language_model(7, favour_stop=-50.0)  # stop never wins: every hypothesis ends at the limit
    search, results = run_search(SamplingParams(max_tokens=4, beam_width=3, n=3), lm)
    assert search.steps == 4 and [h.finish_reason for h in results] == ["length"] * 3
    assert all(len(h.token_ids) == 4 for h in results)
    assert [h.score for h in results] == sorted((h.score for h in results), reverse=True)
    assert len({tuple(h.token_ids) for h in results}) == 3


def test_an_aborted_search_is_made_up_with_its_running_beams():
    lm = language_model(3, favour_stop=-50.0)
    params = SamplingParams(max_tokens=10, beam_width=3, n=3)
    search = BeamSearch(params, frozenset({STOP}), num_prompt_tokens=5, max_model_len=10_000)
    beams = [FakeBeam([], 0.0)]
    for _ in range(2):
        survivors = search.step(beams, torch.stack([lm(b.output_token_ids) for b in beams]))
        beams = [FakeBeam(s.parent.output_token_ids + [s.token], s.cum_logprob) for s in survivors]
    assert not search.done and not search.finished
    results = search.results(beams, "abort")
    assert [h.token_ids for h in results] == [b.output_token_ids for b in beams]
    assert [h.finish_reason for h in results] == ["abort"] * 3
    assert [h.cum_logprob for h in results] == [b.beam_logprob for b in beams]


def test_the_max_model_len_bounds_the_new_tokens():
    search = BeamSearch(SamplingParams(max_tokens=50, beam_width=2), frozenset({STOP}), num_prompt_tokens=95,
                        max_model_len=100)
    assert search.max_new == 5
