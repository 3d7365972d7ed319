"""Models named by a Hugging Face repo id (`"HuggingFaceTB/SmolLM2-135M-Instruct"`, optionally
`"...@revision"`: a branch, a tag or a commit), resolved with huggingface_hub: from its local cache first
(as huggingface_hub lays it out, under $HF_HUB_CACHE), so that a cached model starts with no network at
all, else downloaded when the hub can be reached and $HF_HUB_OFFLINE is not set. Only what the engine
reads is fetched: the config, the tokenizer's files and the safetensors weights."""

from __future__ import annotations

from pathlib import Path

from tieredkv.errors import ModelNotFoundError
from tieredkv.models.spec import SUPPORTED_ARCHITECTURES

FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja", "*.tiktoken"]


def _tried(model: str) -> str:
    return (f"model {model!r} is not \"default\", a local checkpoint directory, or a Hugging Face repo id that "
            f"could be had")


def resolve_hub_model(model: str) -> Path:
    """The local snapshot directory of the repo id `model` (with an optional `@revision`)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError

    repo_id, _, revision = model.partition("@")
    revision = revision or None
    try:
        path = Path(snapshot_download(repo_id, revision=revision, local_files_only=True, allow_patterns=FILES))
    except HFValidationError as e:
        raise ModelNotFoundError(f"{_tried(model)}: not a repo id ({e})") from None
    except (OSError, ValueError):  # not in the cache (LocalEntryNotFoundError, a FileNotFoundError), or no ref
        if constants.HF_HUB_OFFLINE:
            raise ModelNotFoundError(f"{_tried(model)}: not in the Hugging Face cache ({constants.HF_HUB_CACHE}), and "
                                     "HF_HUB_OFFLINE is set, so the hub was not asked") from None
        try:
            path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=FILES))
        except Exception as e2:  # unknown repo or revision, a gated repo, no network: huggingface_hub's many types
            raise ModelNotFoundError(f"{_tried(model)}: not in the Hugging Face cache ({constants.HF_HUB_CACHE}), "
                                     f"and the hub answered {type(e2).__name__}: {_first_line(e2)}") from None
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{_tried(model)}: its snapshot {path} has no config.json (supported: "
                                 f"{', '.join(SUPPORTED_ARCHITECTURES)} checkpoints in safetensors)")
    return path


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]
