"""Incremental text is right for multi-byte characters and stop strings that span tokens."""

import pytest
from transformers import AutoTokenizer

from tieredkv.models.detokenizer import IncrementalDetokenizer
from tieredkv.models.tokenizer import Tokenizer

TEXTS = [
    "Plain ASCII text, with punctuation!",
    "Élan naïve café 東京 🙂🚀 ünïcödé",
    "🚀🚀🚀 emoji only 🙂",
    "  leading spaces and\nnew lines\n\n",
]


@pytest.fixture(scope="module")
def tok(llama_dir):
    return Tokenizer(llama_dir)


def stream_text(tok, prompt_ids, ids, stop=()):
    d = IncrementalDetokenizer(tok, prompt_ids, list(stop))
    pieces = []
    stopped = False
    for t in ids:
        stopped = d.add(t)
        piece = d.take(final=stopped)
        assert "\ufffd" not in piece
        pieces.append(piece)
        if stopped:
            break
    if not stopped:
        pieces.append(d.take(final=True))
    return "".join(pieces), stopped


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_full_decode(tok, text):
    ids = tok.encode(text)
    assert len(ids) > 3
    prompt = tok.encode("Question: ")
    out, _ = stream_text(tok, prompt, ids)
    assert out == tok.decode(ids)


def test_multibyte_characters_split_over_byte_tokens_never_emit_halves(tok):
    ids = tok.encode("🚀")
    pieces = [tok.decode([t]) for t in ids]
    assert len(ids) > 1 and any("\ufffd" in p for p in pieces)  # the tokenizer really splits it
    out, _ = stream_text(tok, [], ids)
    assert out == "🚀"


@pytest.mark.parametrize("stop", ["café", "é 東", "\n\n", "🚀 e"])
def test_stop_string_spanning_tokens(tok, stop):
    text = next(t for t in TEXTS if stop in t)
    ids = tok.encode(text)
    out, stopped = stream_text(tok, [], ids, stop=[stop, "never appears"])
    assert stopped
    assert out == text[: text.index(stop)]


def test_held_back_text_is_released_when_no_stop_matches(tok):
    ids = tok.encode("abc abd abe")
    out, stopped = stream_text(tok, [], ids, stop=["abz"])
    assert not stopped and out == "abc abd abe"


def test_default_tokenizer_chat_template_roundtrip(llama_dir):
    t = Tokenizer(llama_dir)
    ids = t.apply_chat_template([{"role": "user", "content": "hi"}])
    assert t.hf.decode(ids) == AutoTokenizer.from_pretrained(str(llama_dir)).apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
