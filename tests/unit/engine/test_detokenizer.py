"""Incremental detokenizer: UTF-8 safe deltas, stop strings held back and removed."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from sidecar.engine.detokenizer import IncrementalDetokenizer
from sidecar.engine.request import SamplingParams


@pytest.fixture(scope="module")
def tok(demo_dir):
    return AutoTokenizer.from_pretrained(str(demo_dir))


def stream(tok, text: str, stop=()):
    d = IncrementalDetokenizer(tok, SamplingParams(stop=list(stop)))
    deltas, shown = [], ""
    for t in tok.encode(text, add_special_tokens=False):
        hit = d.add_token(t)
        visible = d.visible_text(hit is not None)
        deltas.append(visible[len(shown) :])
        shown = visible
        if hit:
            break
    return d, deltas


@pytest.mark.parametrize(
    "text", ["量子纠缠实验室的研究员说：你好！", "emoji 😀🚀✅ and 👍🏽 mixed", "日本語 ありがとう 🤖"]
)
def test_deltas_never_split_a_character(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    # The byte-level tokenizer really does split these characters across tokens.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    d, deltas = stream(tok, text)
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) == text == d.text


def test_stop_string_removed_and_never_streamed(tok):
    d, deltas = stream(tok, "The answer is 42. STOP here and more text", stop=["STOP"])
    assert d.stopped_by == "STOP"
    assert d.text == "The answer is 42. "
    assert "".join(deltas) == d.text
    assert not any("S" in x and "STOP" in x for x in deltas)


def test_earliest_of_several_stop_strings_wins(tok):
    d, _ = stream(tok, "alpha beta gamma delta", stop=["gamma", "beta"])
    assert d.text == "alpha "
    assert d.stopped_by == "beta"


def test_invalid_bytes_do_not_stall_the_stream(tok):
    # Continuation bytes with no lead byte never form a character; text must still advance.
    byte_tokens = [
        tok.convert_tokens_to_ids(c) for c in ("\u00ae", "\u00af", "\u00b0", "\u00b1", "\u00b2", "\u00b3")
    ]
    assert all(isinstance(t, int) and t >= 0 for t in byte_tokens)
    d = IncrementalDetokenizer(tok, SamplingParams())
    for t in byte_tokens[:4]:
        d.add_token(t)
    assert d.text == ""  # up to 4 pending bytes may still become a character
    for t in byte_tokens[4:]:
        d.add_token(t)
    assert d.text != "" and set(d.text) == {"\ufffd"}
    for t in tok.encode(" ok", add_special_tokens=False):
        d.add_token(t)
    assert d.text.endswith(" ok")


def test_a_long_stop_string_holds_back_only_what_could_still_match(tok):
    long_stop = "Z" + "q" * 4999  # 5,000 characters; the text never starts writing it
    text = "one two three four five six seven eight nine ten"
    d, deltas = stream(tok, text, stop=[long_stop])
    ids = tok.encode(text, add_special_tokens=False)
    assert len([x for x in deltas if x]) == len(ids)  # every token streams at once, not one chunk at the end
    assert "".join(deltas) == text and d.stopped_by is None


def test_a_partly_written_stop_string_is_held_until_it_cannot_match(tok):
    d = IncrementalDetokenizer(tok, SamplingParams(stop=["END OF ANSWER"]))
    shown = ""
    for t in tok.encode("done END OF ANSWEx", add_special_tokens=False):
        d.add_token(t)
        visible = d.visible_text(False)
        assert visible.startswith(shown)
        shown = visible
        assert not shown.endswith(" END")  # a stop prefix is never shown while it may still complete
    assert shown == "done END OF ANSWEx"  # once it cannot, it is released
    d2, deltas = stream(tok, "ab abcab abcabd tail", stop=["abcabd"])  # a border: KMP falls back correctly
    assert d2.text == "ab abcab " and d2.stopped_by == "abcabd"
