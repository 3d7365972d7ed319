"""Every error the engine raises on purpose derives from TieredKVError; catch that for all of them."""

from __future__ import annotations


class TieredKVError(Exception):
    """Base of the engine's own errors. Each pickles as it is, whatever its constructor takes (they cross from the
    engine's core process to the application's: core_process.py)."""

    def __reduce__(self):
        return _rebuild, (type(self), self.args, self.__dict__)


def _rebuild(cls: type[TieredKVError], args: tuple, state: dict) -> TieredKVError:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class RequestError(TieredKVError, ValueError):
    """A request was rejected before anything was allocated for it, or could not be served; the
    engine and every other request go on. `param`: the request field at fault, where one is."""

    def __init__(self, message: str = "", param: str | None = None):
        super().__init__(message)
        self.param = param


class StepError(TieredKVError, RuntimeError):
    """A forward pass failed; the requests in it were aborted and their blocks freed."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"engine step failed for {len(request_ids)} request(s): {cause!r}")
        self.request_ids = request_ids
        self.cause = cause


class EngineClosedError(TieredKVError, RuntimeError):
    """The engine was closed (or its worker died) while the call was pending or running."""


class RankLostError(EngineClosedError):
    """A tensor-parallel rank stopped answering (its process died, or the process group failed): the engine
    closes, and every request in flight ends with this error."""


class RankStartError(TieredKVError, RuntimeError):
    """A tensor-parallel rank could not start: its process died, its device cannot be used, the process group
    could not form, or its share of the model did not load; the message says which."""


class WrongLoopError(TieredKVError, RuntimeError):
    """An engine method was called from another event loop or thread than the one that started it."""


class CheckpointError(TieredKVError, ValueError):
    """The checkpoint's files are missing, truncated or inconsistent."""


class UnsupportedModelError(TieredKVError, ValueError):
    """The checkpoint is not of an architecture this engine implements."""


class SamplingError(TieredKVError, RuntimeError):
    """One request's own work after the shared forward failed: its logits row is not usable numbers, or one of
    its stages (logits processors, structured output, sampling, beam search, stop rules) raised. Only that
    request fails; `stage` names the stage and `fields` the request's settings that it read, where known."""

    def __init__(self, message: str, stage: str | None = None, fields: tuple[str, ...] = ()):
        super().__init__(message)
        self.stage = stage
        self.fields = fields


class ColdTierError(TieredKVError, RuntimeError):
    """The cold folder cannot be opened, or the cold tier's writer thread has stopped."""


class RemoteTierError(TieredKVError, ValueError):
    """`remote_url` cannot be used: the `valkey` client is not installed (the `remote` extra), or the URL is
    not one it takes. A server that is down or slow is not an error: its lookups are misses."""


class LoRAError(TieredKVError, ValueError):
    """A LoRA adapter cannot be served: its folder or files are missing or malformed, it targets a module the
    engine does not change, its shapes or rank do not fit the base model, or its name is unknown or taken."""


class KVEventsError(TieredKVError, ValueError):
    """`kv_events_config` cannot be used: pyzmq is not installed (the `fleet` extra), or an endpoint cannot be
    bound (in use, malformed)."""


class SnapshotError(TieredKVError, ValueError):
    """The file is not a cache snapshot, or was written for another model, dtype, block size or layout."""


class ModelNotFoundError(TieredKVError, FileNotFoundError):
    """`model` is not "default", a local checkpoint directory, or a Hugging Face repo id found in the local
    cache or on the hub; the message says what was tried."""
