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
