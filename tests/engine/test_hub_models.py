"""Models named by a Hugging Face repo id, from a cache laid out as huggingface_hub lays it out, with the hub
out of reach (HF_HUB_OFFLINE); the errors for what cannot be had."""

import shutil

import pytest

from helpers import drive, hf_greedy, make_config
from tieredkv import SamplingParams
from tieredkv.engine.engine_core import EngineCore
from tieredkv.engine.resolve import resolve_model_dir
from tieredkv.errors import ModelNotFoundError, TieredKVError

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub(tmp_path, monkeypatch, llama_dir):
    """$HF_HUB_CACHE holding "acme/tiny-llama" at COMMIT, as main and as tag v1; offline."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-llama"
    snapshot = repo / "snapshots" / COMMIT
    blobs = repo / "blobs"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(p for p in llama_dir.iterdir() if p.is_file())):
        blob = blobs / f"{i:040x}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(f"../../blobs/{blob.name}")  # as huggingface_hub links them
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "refs" / "v1").write_text(COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return snapshot


@pytest.mark.parametrize("name", ["acme/tiny-llama", "acme/tiny-llama@v1", f"acme/tiny-llama@{COMMIT}"])
def test_a_repo_id_is_served_from_the_hugging_face_cache(hub, name):
    assert resolve_model_dir(name) == hub


def test_an_engine_on_a_repo_id_matches_transformers(hub, llama_dir):
    core = EngineCore(make_config(model="acme/tiny-llama", num_blocks=32))
    assert core.model_dir == hub
    req = core.factory.make([5, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True))
    drive(core, [req])
    assert req.seqs[0].output_token_ids == hf_greedy(llama_dir, [[5, 6, 7, 8]], 6)[0]


@pytest.mark.parametrize("name, words", [
    ("acme/unknown-model", ["'acme/unknown-model'", "not in the Hugging Face cache", "HF_HUB_OFFLINE"]),
    ("acme/tiny-llama@v9", ["'acme/tiny-llama@v9'", "not in the Hugging Face cache"]),
    ("not a repo id!", ["not a repo id"]),
    ("./nowhere", ["no such directory"]),
])
def test_what_cannot_be_had_is_an_error_of_the_projects_own_naming_what_was_tried(hub, name, words):
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model_dir(name)
    assert isinstance(e.value, TieredKVError) and isinstance(e.value, FileNotFoundError)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_a_snapshot_without_a_config_names_what_is_supported(hub):
    (hub / "config.json").unlink()
    with pytest.raises(ModelNotFoundError, match="no config.json .*LlamaForCausalLM"):
        resolve_model_dir("acme/tiny-llama")
