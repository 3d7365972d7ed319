"""A request's failure stays its own: the work after the shared forward that belongs to single requests
(logits processors, structured output, sampling, beam search, stop rules) runs batched, and when a batched
call raises, each item runs again alone, so that only the items whose own run raises fail.

Why retry rather than check: the batched stages are tensor operations over many requests' rows; an
exception names no row. Running the items alone costs nothing while nothing fails, and finds exactly the
requests that fail, whatever the cause (a parameter no check foresaw, a grammar engine's error, a bug)."""

from __future__ import annotations

from typing import Callable, TypeVar, cast

from tieredkv.config import SamplingParams
from tieredkv.errors import SamplingError, TieredKVError

T = TypeVar("T")
R = TypeVar("R")

# the SamplingParams fields each stage reads: an error names those the request set
_PROCESSORS = ("logit_bias", "min_tokens", "repetition_penalty", "frequency_penalty", "presence_penalty")
STAGE_FIELDS: dict[str, tuple[str, ...]] = {
    "logits processors": _PROCESSORS,  # beams' rows (sampling applies a sampled row's processors itself)
    "structured output": ("json_schema", "grammar"),
    "sampling": _PROCESSORS + ("temperature", "top_k", "top_p", "min_p", "seed", "logprobs"),
    "beam search": ("beam_width", "length_penalty", "early_stopping", "n"),
    "stop rules": ("stop", "stop_token_ids", "min_tokens", "max_tokens", "ignore_eos"),
}


def stage_error(stage: str, params: SamplingParams, cause: BaseException) -> TieredKVError:
    """The error one request fails with when its `stage` raised `cause`: the engine's own errors as they
    are, anything else as a SamplingError naming the stage and the fields of that stage the request set."""
    if isinstance(cause, TieredKVError):
        return cause
    fields = tuple(f for f in STAGE_FIELDS[stage] if f in params.model_fields_set)
    given = ", ".join(f"{f}={_short(getattr(params, f))}" for f in fields)
    return SamplingError(f"the request's {stage} failed{f' ({given})' if given else ''}: {cause!r}", stage, fields)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def isolated(stage: str, items: list[T], run: Callable[[list[T]], list[R]],
             params_of: Callable[[T], SamplingParams],
             restore: Callable[[], None] | None = None) -> list[R | TieredKVError]:
    """run(items) -> one result per item, in order. When that raises, `restore()` (undo what the failed call
    may have changed in place), then run([item]) for each item alone: an item whose own run raises gets
    its stage_error in place of a result. `run` must give the same result for an item alone as batched."""
    try:
        return cast("list[R | TieredKVError]", run(items))  # (a list of R is one of R or errors)
    except Exception as batched:
        if restore is not None:
            restore()
        if len(items) == 1:
            return [stage_error(stage, params_of(items[0]), batched)]
    out: list[R | TieredKVError] = []
    for item in items:
        try:
            out.extend(run([item]))
        except Exception as e:
            out.append(stage_error(stage, params_of(item), e))
    return out
