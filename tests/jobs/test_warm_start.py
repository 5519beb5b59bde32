"""The warm start's Ctrl-C: a KeyboardInterrupt that lands inside a simulator call comes back
wrapped in the simulator client's own error; the warm start turns it back into the
KeyboardInterrupt the entry points answer with one line."""
from __future__ import annotations

import pytest

from configs import builtin
from strata_jax.jobs import warm_start


class Py4JLikeError(Exception):
    pass


def _collect_interrupted(*args, **kwargs):
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        raise Py4JLikeError("An error occurred while receiving")   # context: the Ctrl-C


def _collect_broken(*args, **kwargs):
    raise Py4JLikeError("Answer from Java side is empty")


def test_interrupted_follows_cause_and_context():
    inner = KeyboardInterrupt()
    outer = RuntimeError("wrapped")
    outer.__context__ = inner
    assert warm_start.interrupted(outer) and warm_start.interrupted(inner)
    assert not warm_start.interrupted(RuntimeError("plain"))


def test_ctrl_c_inside_the_expert_episodes_is_a_keyboard_interrupt(monkeypatch):
    c = builtin.get_config("tiny")
    monkeypatch.setattr(warm_start, "collect_expert_episodes", _collect_interrupted)
    with pytest.raises(KeyboardInterrupt) as info:
        warm_start.sft_examples(c, tokenizer=None)
    assert info.value.__context__ is None or info.value.__suppress_context__
    monkeypatch.setattr(warm_start, "collect_expert_episodes", _collect_broken)
    with pytest.raises(Py4JLikeError, match="Answer from Java side is empty"):
        warm_start.sft_examples(c, tokenizer=None)
