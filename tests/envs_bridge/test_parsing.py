"""Action parsing table (docs/method.md §2.1)."""
import pytest

from envs_bridge.parsing import contains_cjk, parse_action

LONG_THINK = "step " * 5000

CASES = [
    # (output, expected action, expected valid)
    ("<think>go</think><action>open door</action>", "open door", True),
    ("<think>x</think>\n<action>  Open Door To Kitchen </action>", "open door to kitchen", True),  # upper case, spaces
    ("<THINK>x</THINK><ACTION>LOOK</ACTION>", "look", True),  # upper-case tags
    ("<think>a</think><action>look</action><action>go north</action>", "look", True),  # first block wins
    ("Sure! <think>a</think> some text <action>go north</action> trailing", "go north", True),  # extra text
    ("<action>look</action>", None, False),  # missing think
    ("<think>a</think>look around", None, False),  # missing action
    ("<think>a</think><action>look", None, False),  # unclosed action
    ("<think>a<action>look</action>", None, False),  # unclosed think
    ("<think>a</think><action></action>", None, False),  # empty action
    ("<think>a</think><action>   \n </action>", None, False),  # whitespace-only action
    ("<think>a</think><action><action>go</action></action>", None, False),  # nested action tags
    ("<think>去厨房</think><action>go to kitchen</action>", None, False),  # CJK in think
    ("<think>a</think><action>打开门</action>", None, False),  # CJK in action
    ("<think>a</think><action>look</action> 好的", None, False),  # CJK outside the blocks
    ("<think>a</think><action>ｌｏｏｋ</action>", None, False),  # fullwidth forms count as CJK
    ("", None, False),  # empty output
    (f"<think>{LONG_THINK}</think><action>wait</action>", "wait", True),  # very long output
    (f"<think>{LONG_THINK}", None, False),  # very long, truncated before any action
    ("<think>a</think><action>move\n  apple 1\tto fridge 1</action>", "move apple 1 to fridge 1", True),
    ("<think></think><action>click[Buy Now]</action>", "click[buy now]", True),  # empty think is allowed
    ("<think>a</think><action>\u200b\u200b</action>", None, False),  # zero-width spaces only
    ("<think>a</think><action>\x00\ufeff \u202e</action>", None, False),  # NUL, BOM, bidi only
    ("<think>a</think><action>go\u200b north\x00</action>", "go north", True),  # noise dropped
    # The action is the first block AFTER the closed think block; blocks inside it are not run.
    ("<think>Do not do <action>focus on orange</action> yet.</think>\n<action>look around</action>",
     "look around", True),
    ("<think>maybe <action>focus on orange</action></think> no action after", None, False),
    ("<action>focus on orange</action><think>a</think><action>look</action>", "look", True),
    ("<action>focus on orange</action><think>a</think>", None, False),  # only before think
    ("<think>a <action>x</think></action><action>go</action>", "go", True),  # open tag in think
    # blank-looking characters that are not Cc / Cf: nothing visible is left, so invalid
    ("<think>a</think><action>\u3164\u2800</action>", None, False),  # hangul filler, braille blank
    ("<think>a</think><action>\u00ad\u2060\u034f\ufe0f</action>", None, False),  # SHY WJ CGJ VS16
    ("<think>a</think><action>\ue000\U000e0041</action>", None, False),  # private use, tag A
    ("<think>a</think><action>go\u3164 north</action>", "go\u3164 north", True),  # words stay
]


@pytest.mark.parametrize("output,action,valid", CASES)
def test_parse_table(output, action, valid):
    got = parse_action(output)
    assert (got.action, got.valid) == (action, valid)
    assert (got.reason == "") == valid


def test_table_size():
    assert len(CASES) >= 15


def test_think_body_and_cjk_detector():
    assert parse_action("<think> plan A </think><action>go</action>").think == "plan A"
    assert contains_cjk("カタカナ") and contains_cjk("한국어") and not contains_cjk("café naïve ü")


# Characters a policy can write that have broken parsers elsewhere: every invisible class,
# surrogates, huge digit runs, the tags themselves in any case, RTL and CJK text.
_HOSTILE = (["<think>", "</think>", "<action>", "</action>", "<ACTION>", "<strategy>",
             "</strategy>", "<bad_steps>", "</bad_steps>", "none", ", ", "-", "+", " ", "\n",
             "9" * 5000, "0" * 4400 + "1", "\u200b", "\u200d", "\u2060", "\ufeff", "\u00ad",
             "\u3164", "\u2800", "\x00", "\x1b[31m", "\ud800", "\udfff", "\U0010ffff",
             "\u202e", "\u0301", "\uff11", "\u0663", "\u00b2", "go north", "先", "\r\n"])


def _hostile_texts(n, seed):
    import random
    rng = random.Random(seed)
    for _ in range(n):
        yield "".join(rng.choice(_HOSTILE) if rng.random() < 0.7 else chr(rng.randrange(0x110000))
                      for _ in range(rng.randrange(0, 12)))


def test_every_parser_answers_any_text_without_an_exception():
    from strata_jax.rollout import check_strategy, parse_bad_steps
    count = lambda s: len(s.split())  # noqa: E731
    for text in _hostile_texts(3000, seed=0):
        got = parse_action(text)
        assert got.valid == (got.action is not None)
        check_strategy(text, False, count)
        assert all(1 <= s <= 7 for s in parse_bad_steps(text, 7))
