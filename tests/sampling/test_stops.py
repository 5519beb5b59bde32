"""Stop strings as a token transition table: the real offline Qwen2.5 tokenizer (spellings split
over several tokens, starting and ending inside a token), ordered patterns, case, special ids,
and a brute-force text reference on random byte vocabularies."""
from __future__ import annotations

import numpy as np
import pytest

from strata_jax.models import load_tokenizer
from strata_jax.rollout.prompts import ACTION_STOP
from strata_jax.sampling import SamplingParams
from strata_jax.sampling.stops import (STATE_BUCKET, build_stop_text, build_stop_text_from_bytes,
                                       token_bytes)

ISSUE_14 = ("<think>walk on</think><action>go north</action>\nObservation: The vault swings open. "
            "You win.\n<think>done</think><action>enter 000</action>")
ISSUE_13 = ("<think>Do not do <action>focus on orange</action> yet.</think>\n"
            "<action>look around</action>")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def action_stop(tok):
    return build_stop_text(tok, ACTION_STOP)


def _cut(tok, stop, text):
    ids = tok.encode(text, add_special_tokens=False)
    n = stop.scan(ids)
    return tok.convert_ids_to_tokens(ids[:n]), tok.decode(ids[:n]), n


def _text_reference(pieces, patterns):
    """Tokens up to the one whose text completes `patterns` in order (case-insensitive), else 0."""
    text = ""
    for n, piece in enumerate(pieces, start=1):
        text += piece.lower()
        pos = 0
        for p in patterns:
            k = text.find(p.lower(), pos)
            if k < 0:
                break
            pos = k + len(p)
        else:
            return n
    return 0


def test_the_issue_reply_stops_at_the_end_of_the_first_action_block(tok, action_stop):
    pieces, text, n = _cut(tok, action_stop, ISSUE_14)
    # '</think>' ends inside the token '><' that also starts '<action>'; '</action>' is spelled
    # '</' 'action' '>\n' and ends inside its last token, whose '\n' stays in the output.
    assert pieces == ["<th", "ink", ">w", "alk", "Ġon", "</", "think", "><", "action", ">", "go",
                      "Ġnorth", "</", "action", ">Ċ"]
    assert text == "<think>walk on</think><action>go north</action>\n" and n == 15


def test_an_action_block_inside_the_think_block_does_not_stop(tok, action_stop):
    _, text, _ = _cut(tok, action_stop, ISSUE_13)
    assert text == ISSUE_13  # the first </action> (inside the think block) is passed over
    _, text, _ = _cut(tok, action_stop, "<think>a</think> x</action> <action>go</action>!")
    assert text == "<think>a</think> x</action> <action>go</action>"  # the parser's block
    _, text, _ = _cut(tok, action_stop, "<think>x.</think>\n\n<ACTION>a.</Action>> more")
    assert text == "<think>x.</think>\n\n<ACTION>a.</Action>>"  # case-insensitive, '.</' split
    for text in ("<think>still thinking <action>x</action>", "<action>go</action>",
                 "<think>a</think><action>x</act<|im_end|>ion>",
                 "<think>a</think> a stray </action> and no block"):
        assert _cut(tok, action_stop, text)[2] == 0, text  # never completed


def test_table_scan_equals_a_text_reference_on_real_tokens(tok, action_stop):
    texts = [ISSUE_13, ISSUE_14, "</action><think>q</think> <</action>x",
             "<think>a</think>\n<action>b</action></action>", "<think></think><action></action>",
             "<<//think>></think></actio</action>", "<think>é</think><action>café</action>"]
    rng = np.random.default_rng(0)
    alphabet = ["<", "/", "think", "action", ">", "</", " ", "\n", "a", "T", "ACTION", ".</",
                "</think>", "</action>", "><", ">\n", "<action>", "<ACTION>"]
    texts += ["".join(rng.choice(alphabet, 30)) for _ in range(200)]
    hits = 0
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        pieces = [tok.decode([i]) for i in ids]
        want = _text_reference(pieces, ACTION_STOP)
        assert action_stop.scan(ids) == want, text
        hits += want > 0
    assert hits > 20  # the random texts do complete the pattern, at many positions


def test_random_byte_vocabularies_match_the_text_reference():
    rng = np.random.default_rng(1)
    alphabet = [b"a", b"b", b"c", b"ab", b"ba", b"cab", b"bca", b"", b"B"]
    for trial in range(20):
        vocab = [alphabet[i] for i in rng.integers(0, len(alphabet), 40)] + [None] * 3
        patterns = [("abc",), ("aba",), ("ab", "ca"), ("bab", "b", "cc")][trial % 4]
        stop = build_stop_text_from_bytes(vocab, patterns)
        for _ in range(50):
            ids = rng.integers(0, len(vocab), 25)
            # a special id (None) spells nothing and separates: use a NUL in the reference text
            pieces = [(b"\0" if vocab[i] is None else vocab[i]).decode() for i in ids]
            assert stop.scan(ids) == _text_reference(pieces, patterns), (patterns, ids)


def test_table_shape_special_ids_and_vocab_widening(tok, action_stop):
    v = len(tok)
    assert action_stop.table.shape == (STATE_BUCKET, v) and action_stop.table.dtype == np.int16
    assert action_stop.accept == len("</think>") + len("<action>") + len("</action>")
    assert build_stop_text(tok, ACTION_STOP) is action_stop  # cached per tokenizer
    tb = token_bytes(tok)
    assert tb[151645] is None and tb[522] == b"</" and tb[397] == b">\n"
    assert tb[151657] == b"<tool_call>"  # added, not special: its text
    # <|im_end|> inside a half-written tag resets the progress on that tag
    ids = tok.encode("<think>a</", add_special_tokens=False) + [151645] + \
        tok.encode("think>", add_special_tokens=False)
    assert action_stop.scan(ids) == 0
    wide = action_stop.table_for_vocab(151936)
    assert wide.shape == (STATE_BUCKET, 151936)
    np.testing.assert_array_equal(wide[:, 151700], action_stop.reset)
    np.testing.assert_array_equal(wide[:, :v], action_stop.table)
    with pytest.raises(ValueError, match="non-empty"):
        build_stop_text_from_bytes([b"a"], ("",))
    with pytest.raises(ValueError, match="stop_text must be a StopText"):
        SamplingParams(stop_text="</action>")
