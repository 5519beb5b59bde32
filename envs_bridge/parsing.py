"""Action parsing: `<think>...</think><action>...</action>` (docs/method.md §2.1).

Rules [P]:

* The action is the FIRST `<action>...</action>` block that starts AFTER the closed think block
  (the first `<think>` and the first `</think>` after it); without such a block the output is
  format-invalid. An `<action>` block inside the think block (or before it) is never executed:
  ``"<think>Do not do <action>focus on orange</action> yet.</think>\n<action>look around</action>"``
  parses to ``look around``.
* The action is that block's body, stripped and lower-cased; runs of whitespace inside it
  collapse to one space.
* The output is valid only if it holds that closed think block and, after it, a closed,
  non-empty `<action>` block, and contains no CJK character anywhere.
* Invalid output yields `ParsedAction(action=None, valid=False)` (an invalid step, never an
  exception).
* Tag matching is case-insensitive (`<Action>` counts). A nested `<action>` inside the action
  block makes it invalid (the model did not produce one clean action). Control and format
  characters (Unicode categories Cc / Cf: NUL, zero-width space, BOM, bidi marks) are dropped
  from the action; an action with no visible character left (only blank-looking letters such
  as U+3164 or U+2800, combining marks, private-use or unassigned code points:
  `has_visible_text`) is empty, hence invalid.

The step prompt states the same rule to the model (`strata_jax.rollout.prompts.STEP_INSTRUCTION`),
and the sampler stops generating at the end of that block (`strata_jax.sampling.stops`).
"""
from __future__ import annotations

import dataclasses
import re
import unicodedata

_THINK_RE = re.compile(r"<think>(.*?)</think>", re.IGNORECASE | re.DOTALL)
_ACTION_RE = re.compile(r"<action>(.*?)</action>", re.IGNORECASE | re.DOTALL)
# CJK Unified Ideographs (+ext A, compatibility), kana, hangul, CJK punctuation, fullwidth forms.
_CJK_RE = re.compile(
    "[\u3000-\u303f\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\uff00-\uffef]"
)


@dataclasses.dataclass(frozen=True)
class ParsedAction:
    """Result of `parse_action`.

    Attributes:
      action: lower-cased, stripped action text, or None when `valid` is False.
      valid: True iff the output passed the format rules in the module docstring.
      think: body of the first think block (stripped; "" when absent).
      reason: why the output was invalid ("" when valid), for logs.
    """

    action: str | None
    valid: bool
    think: str = ""
    reason: str = ""


# Letters and symbols that render as nothing (or as blank space) although their Unicode
# category is not a space / format / control one: Hangul fillers (U+115F, U+1160, U+3164,
# U+FFA0), the Braille blank (U+2800), Khmer inherent vowels (U+17B4, U+17B5, category Mn but
# listed for clarity), the Mongolian vowel separator (U+180E, Cf in current Unicode).
_BLANK_LOOKING = frozenset("\u115f\u1160\u3164\uffa0\u2800\u17b4\u17b5\u180e")
# Categories that never draw a glyph of their own: separators (Zs, Zl, Zp), controls (Cc),
# format characters (Cf: zero-width space / joiners, U+2060, U+FEFF, soft hyphen, bidi marks,
# tags), surrogates (Cs), private use (Co), unassigned (Cn), and combining marks (Mn, Me),
# which only decorate a neighbour (a lone combining grapheme joiner or variation selector).
_INVISIBLE_CATEGORIES = frozenset(("Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co", "Cn", "Mn", "Me"))


def is_visible_char(ch: str) -> bool:
    """True when the one-character string `ch` draws a glyph of its own (see
    `_INVISIBLE_CATEGORIES` and `_BLANK_LOOKING`): a text with none of them reads as blank."""
    return ch not in _BLANK_LOOKING and unicodedata.category(ch) not in _INVISIBLE_CATEGORIES


def has_visible_text(text: str) -> bool:
    """True when `text` holds at least one visible character (`is_visible_char`). A strategy
    or an action written only with zero-width characters, U+2060, U+FEFF, soft hyphens,
    U+3164, U+2800, combining marks or control characters is blank to a reader and to the env."""
    return any(is_visible_char(ch) for ch in text)


def contains_cjk(text: str) -> bool:
    """True if `text` contains a CJK ideograph, kana, hangul, or CJK/fullwidth punctuation."""
    return _CJK_RE.search(text) is not None


def parse_action(output: str) -> ParsedAction:
    """Parse one model output into an env action (see module docstring for the rules).

    Args:
      output: the decoded response text.
    Returns:
      ParsedAction; never raises on any string input.
    """
    if contains_cjk(output):
        return ParsedAction(None, False, reason="cjk")
    think = _THINK_RE.search(output)
    if think is None:
        return ParsedAction(None, False, reason="missing think block")
    # Only what follows the closed think block can hold the action (see the module docstring).
    act = _ACTION_RE.search(output, think.end())
    if act is None:
        return ParsedAction(None, False, think.group(1).strip(),
                            reason="missing action block after </think>")
    body = act.group(1)
    if re.search(r"<action>", body, re.IGNORECASE):
        return ParsedAction(None, False, think.group(1).strip(), reason="nested action tags")
    # Whitespace (incl. \t, \n) separates words; other control / format characters are noise the
    # env would never match, and would make a blank-looking action "valid".
    body = "".join(ch for ch in body if ch.isspace()
                   or unicodedata.category(ch) not in ("Cc", "Cf"))
    action = " ".join(body.split()).lower()
    if not has_visible_text(action):
        return ParsedAction(None, False, think.group(1).strip(), reason="empty action")
    return ParsedAction(action, True, think.group(1).strip())
