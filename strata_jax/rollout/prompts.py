"""Step, strategy, judge and strategy-revision prompts (docs/method.md §3).

Every prompt is ONE user message rendered through the tokenizer's Qwen2.5 chat template with
no custom system message (the template then inserts Qwen's default system prompt, as the
Instruct models were trained with). Its content is laid out so that the longest possible
part is shared between rows:

    prefix:  [chat header: system turn + "<|im_start|>user\\n"]
             role line ("You are an expert agent in {environment}.")
             task ("Your task: ...")
             strategy block ("Your strategy for this task:\\n{z}")       (StraTA only)
    suffix:  history window ("You have taken k steps; your last h observations and actions
             were: ..."), current observation ("You are at step k+1; current observation: ..."),
             a notice after a format-invalid output, admissible actions or action templates,
             the instruction (reason in <think></think>, one action in <action></action>),
             [chat footer: "<|im_end|>\\n<|im_start|>assistant\\n"]

Prefix / suffix split (decided here): the chat header belongs to the prefix and the footer
(end of the user turn + the assistant header) to the suffix, so the sampler's
``generate_with_prefixes(prefixes, prefix_index, suffixes)`` sees exactly
``prefix_ids + suffix_ids`` and the training batch stores exactly that concatenation. The
prefix text always ends with a newline and the suffix text starts with a letter: Qwen's
pre-tokenizer never merges a token across that boundary, so the two separate encodings equal
the encoding of the whole rendered prompt (tested), i.e. splitting changes nothing the model
sees. All M episodes of a strategy (StraTA), or all G episodes of a task (flat), share one
prefix; the sigma*N strategy candidates of a task share theirs; a trajectory's judge prompt
shares the prefix of its step prompts.

Special tokens come only from the chat template. Everything inside the user turn (task, env
observations, history actions, the model's own strategy, decoded model text) is untrusted text:
it is tokenised with special-token strings treated as plain text (``split_special_tokens``), so
an observation holding ``<|im_end|>\n<|im_start|>assistant\n`` or a history entry ending in
``<|endoftext|>`` is spelled with ordinary BPE pieces and cannot close the user turn, open a
fake assistant turn or insert the pad id. The template's header and footer are tokenised on their
own, with their special ids. A flat step prompt therefore always holds exactly three
``<|im_start|>`` and two ``<|im_end|>`` ids, and decoding the ids gives back the rendered text.

Token budget (``max_prompt_tokens``, per env): history entries are dropped, oldest first, until
the prompt fits; only with no history left is the current observation truncated (head kept,
" ...[truncated]" appended). Non-cumulative prompts keep at most ``history_length`` entries
(pinned 2); cumulative prompts (STAPO) pass ``history_length=None`` = the whole trajectory,
with the same oldest-first dropping.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from envs_bridge.base import PromptPieces

_MARK = "\ue000"  # private-use code point: splits the rendered template around the content
TRUNCATION_MARK = " ...[truncated]"
INVALID_NOTICE = ("Note: your last output had no valid action (it needs <think>...</think> "
                  "followed by one <action>...</action>), so nothing happened; the observation "
                  "is unchanged.")
# The parsing rule of `envs_bridge.parsing`, stated to the model: only the first action block
# after </think> is executed (an action written inside the think block is not).
STEP_INSTRUCTION = ("Now think step by step about what to do next inside <think></think>, then "
                    "give exactly one action inside <action></action> after </think>; only the "
                    "first action block after </think> is executed.")
# Optional answer templates (``rollout.format_examples``, off in the paper setting): one line
# showing the exact tag layout, appended to the step / strategy instruction. A small pretrained
# model that knows the task often writes the action inside <think> or a plan without tags;
# the template states the layout the parser needs without suggesting any particular action.
STEP_FORMAT_EXAMPLE = (" Answer in exactly this form and write nothing after it: "
                       "<think>your reasoning</think><action>one action</action>")
STRATEGY_FORMAT_EXAMPLE = (" Answer in exactly this form: <strategy>1. first sub-goal "
                           "2. next sub-goal ...</strategy>")
STRATEGY_INSTRUCTION = ("Before acting, write a concise, ordered plan of the sub-goals that "
                        "solve this task inside <strategy></strategy>. Do not give any action.")
# Strategy revision (an option, docs/method.md §5.9): the step prompt's prefix (with the plan in
# force) and history, then this request instead of the step instruction.
REVISION_INSTRUCTION = ("Your strategy may not be working. Considering the steps so far, the "
                        "current observation and your strategy, write a revised, concise, "
                        "ordered plan of the sub-goals that remain inside "
                        "<strategy></strategy>. Do not give any action.")
# Where each stage's generation ends (stop strings, matched in order on device by the sampler:
# `strata_jax.sampling.stops`): the end of the first action block after </think> (the block
# the parser executes), the first </strategy>, the first </bad_steps> (only the first counts).
ACTION_STOP = ("</think>", "<action>", "</action>")
STRATEGY_STOP = ("</strategy>",)
JUDGE_STOP = ("</bad_steps>",)
JUDGE_INSTRUCTION = (
    "For each step, ask two questions: does the action follow the strategy, and does it advance "
    "the task? List the numbers of the steps that do neither inside <bad_steps></bad_steps>, "
    "comma separated, for example <bad_steps>1, 4</bad_steps>, or answer "
    "<bad_steps>none</bad_steps> if there is no such step.")


@dataclasses.dataclass(frozen=True)
class PromptIds:
    """One tokenised prompt, split for the sampler's shared-prefix interface.

    Attributes:
      prefix_ids: chat header + role + task (+ strategy) token ids.
      suffix_ids: the rest of the user turn + the assistant header, token ids (>= 1).
      prefix_text / suffix_text: the rendered text of each part (logs, dumps).
      history_used: history entries shown (step prompts; 0 otherwise).
      truncated: the current observation was truncated to fit the budget.
    """

    prefix_ids: tuple[int, ...]
    suffix_ids: tuple[int, ...]
    prefix_text: str
    suffix_text: str
    history_used: int = 0
    truncated: bool = False

    @property
    def ids(self) -> list[int]:
        """The whole prompt the model sees: prefix_ids + suffix_ids."""
        return list(self.prefix_ids) + list(self.suffix_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.prefix_ids) + len(self.suffix_ids)

    @property
    def text(self) -> str:
        """The rendered prompt text."""
        return self.prefix_text + self.suffix_text


@dataclasses.dataclass(frozen=True)
class HistoryEntry:
    """One past step as the history window shows it (docs/method.md §3.1).

    Attributes:
      observation: the raw env observation the step acted on.
      action: the parsed action, or for a format-invalid step a note with the tail of the
        raw output (`invalid_history_action`).
    """

    observation: str
    action: str


def invalid_history_action(raw_output: str, tail_chars: int = 30) -> str:
    """History text of a format-invalid step: the tail (~30 chars) of the raw output."""
    tail = " ".join(raw_output.split())[-tail_chars:]
    return f"(no valid action; your output ended with: \"{tail}\")"


class PromptBuilder:
    """Builds tokenised step / strategy / judge prompts under a token budget.

    Args:
      tokenizer: a transformers tokenizer with the Qwen2.5 chat template
        (``strata_jax.models.load_tokenizer``).
      max_prompt_tokens: budget per prompt (docs/method.md §3.4: ALFWorld 2048, WebShop /
        ScienceWorld 4096).
      history_length: (obs, action) pairs shown (pinned 2); None = the whole trajectory
        (cumulative prompts, STAPO).
      judge_obs_chars: each observation in the judge prompt is cut to this many characters.
      format_examples: append `STEP_FORMAT_EXAMPLE` / `STRATEGY_FORMAT_EXAMPLE` (the exact tag
        layout) to the step and strategy instructions (``rollout.format_examples``; off = the
        paper's prompts, docs/method.md §3).
    Raises:
      ValueError: a tokenizer whose chat template does not place the content in one user turn,
        or that cannot tokenise special-token strings as plain text (``split_special_tokens``).
    """

    def __init__(self, tokenizer: Any, max_prompt_tokens: int = 4096,
                 history_length: int | None = 2, judge_obs_chars: int = 200,
                 format_examples: bool = False) -> None:
        if max_prompt_tokens < 16:
            raise ValueError(f"max_prompt_tokens must be >= 16, got {max_prompt_tokens}")
        if history_length is not None and history_length < 0:
            raise ValueError(f"history_length must be >= 0 or None, got {history_length}")
        self.tokenizer = tokenizer
        self.max_prompt_tokens = int(max_prompt_tokens)
        self.history_length = history_length
        self.judge_obs_chars = int(judge_obs_chars)
        self.step_instruction = STEP_INSTRUCTION + (STEP_FORMAT_EXAMPLE if format_examples else "")
        self.strategy_instruction = STRATEGY_INSTRUCTION + (
            STRATEGY_FORMAT_EXAMPLE if format_examples else "")
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}],
                                                 tokenize=False, add_generation_prompt=True)
        if rendered.count(_MARK) != 1:
            raise ValueError("the tokenizer's chat template must render the user content once")
        self.chat_header, self.chat_footer = rendered.split(_MARK)
        # The only special ids a prompt holds: the template's, tokenised with specials parsed.
        self._header_ids = tuple(tokenizer.encode(self.chat_header, add_special_tokens=False))
        self._footer_ids = tuple(tokenizer.encode(self.chat_footer, add_special_tokens=False))
        special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        probe = "".join(getattr(tokenizer, "all_special_tokens", ()) or ())
        if probe and special & set(self.encode(probe)):
            raise ValueError("this tokenizer maps special-token strings in plain text to special "
                             "ids even with split_special_tokens=True; use a transformers fast "
                             "tokenizer (transformers >= 4.40)")
        self._prefix_cache: dict[str, tuple[int, ...]] = {}

    # ------------------------------------------------------------------ tokenising

    def encode(self, text: str) -> list[int]:
        """Token ids of untrusted content `text`: special-token strings such as <|im_start|>
        are spelled as plain text (ordinary BPE ids), never mapped to their special ids."""
        return list(self.tokenizer.encode(text, add_special_tokens=False,
                                          split_special_tokens=True))

    def count_tokens(self, text: str) -> int:
        """Token count of `text`."""
        return len(self.encode(text))

    def _prefix_ids(self, text: str) -> tuple[int, ...]:
        ids = self._prefix_cache.get(text)
        if ids is None:
            ids = self._header_ids + tuple(self.encode(text))
            if len(self._prefix_cache) > 4096:
                self._prefix_cache.clear()
            self._prefix_cache[text] = ids
        return ids

    def _make(self, prefix: str, suffix: str, **kw: Any) -> PromptIds:
        if not prefix.endswith("\n") or not suffix[:1].isalpha():
            raise AssertionError("prefix must end with a newline and suffix start with a letter")
        return PromptIds(self._prefix_ids(prefix), tuple(self.encode(suffix)) + self._footer_ids,
                         self.chat_header + prefix, suffix + self.chat_footer, **kw)

    # ------------------------------------------------------------------ text pieces

    @staticmethod
    def prefix_text(pieces: PromptPieces, strategy: str | None = None) -> str:
        """Role line, task and (StraTA) strategy block; ends with a newline."""
        text = (f"You are an expert agent in {pieces.environment.strip()}.\n"
                f"Your task: {pieces.task_description.strip()}\n")
        if strategy is not None:
            text += f"Your strategy for this task:\n{strategy.strip()}\n"
        return text

    @staticmethod
    def actions_text(pieces: PromptPieces) -> str:
        """Admissible actions (ALFWorld / WebShop / built-ins) or action templates
        (ScienceWorld); "" when the env lists neither."""
        if pieces.admissible_actions is not None:
            return "Admissible actions: [" + ", ".join(pieces.admissible_actions) + "]\n"
        if pieces.action_templates:
            return "Valid action templates: [" + ", ".join(pieces.action_templates) + "]\n"
        return ""

    def _fit(self, render: Callable[[str, int], PromptIds], observation: str,
             max_history: int) -> PromptIds:
        """Drop history (oldest first), then truncate the observation, until the budget holds."""
        for h in range(max_history, -1, -1):
            p = render(observation, h)
            if p.num_tokens <= self.max_prompt_tokens:
                return p
        obs_ids = self.encode(observation)
        keep = len(obs_ids)
        while True:
            excess = p.num_tokens - self.max_prompt_tokens
            keep = keep - excess - 4
            if keep <= 0:
                raise ValueError(
                    f"prompt does not fit max_prompt_tokens={self.max_prompt_tokens} even with no "
                    f"history and an empty observation ({p.num_tokens} tokens); raise "
                    f"env.max_prompt_tokens")
            short = self.tokenizer.decode(obs_ids[:keep]) + TRUNCATION_MARK
            p = dataclasses.replace(render(short, 0), truncated=True)
            if p.num_tokens <= self.max_prompt_tokens:
                return p

    # ------------------------------------------------------------------ prompts

    def step_prompt(self, pieces: PromptPieces, observation: str, history: Sequence[HistoryEntry],
                    strategy: str | None = None, invalid_notice: bool = False) -> PromptIds:
        """The prompt of the next step (docs/method.md §3.1).

        Args:
          pieces: the env's prompt pieces now (admissible actions of this state).
          observation: the current raw observation.
          history: every past step of the episode, oldest first (k = len(history) steps taken;
            format-invalid ones included).
          strategy: z (StraTA) or None.
          invalid_notice: the last output was format-invalid (adds a short notice).
        Returns:
          `PromptIds` within the budget.
        Raises:
          ValueError: the fixed parts alone exceed the budget.
        """
        tail = ((INVALID_NOTICE + "\n") if invalid_notice else "") + self.actions_text(pieces) \
            + self.step_instruction
        return self._history_prompt(pieces, observation, history, strategy, tail)

    def revision_prompt(self, pieces: PromptPieces, observation: str,
                        history: Sequence[HistoryEntry], strategy: str | None) -> PromptIds:
        """Strategy-revision prompt (docs/method.md §5.9): the step prompt of this point
        (prefix with the strategy in force, the history window as a short summary of the steps
        so far, the current observation, the actions) with `REVISION_INSTRUCTION` in place of the
        step instruction; the answer is a new plan in <strategy></strategy>.

        Args / Raises: as `step_prompt` (history must hold at least one step)."""
        if not history:
            raise ValueError("revision_prompt needs at least one step of history")
        return self._history_prompt(pieces, observation, history, strategy,
                                    self.actions_text(pieces) + REVISION_INSTRUCTION)

    def _history_prompt(self, pieces: PromptPieces, observation: str,
                        history: Sequence[HistoryEntry], strategy: str | None,
                        tail: str) -> PromptIds:
        """Prefix (role, task, strategy) + history window + current observation + `tail`."""
        k = len(history)
        window = k if self.history_length is None else min(k, self.history_length)
        prefix = self.prefix_text(pieces, strategy)

        def render(obs: str, h: int) -> PromptIds:
            if k == 0:
                body = f"Current observation: {obs}\n"
            else:
                body = f"You have taken {k} steps"
                if h:
                    body += f"; your last {h} observations and actions were:\n"
                    for i, e in enumerate(history[k - h:], start=k - h + 1):
                        body += f"[Step {i}] Observation: {e.observation}\nAction: {e.action}\n"
                else:
                    body += ".\n"
                body += f"You are at step {k + 1}; current observation: {obs}\n"
            return self._make(prefix, body + tail, history_used=h)

        return self._fit(render, observation, window)

    def strategy_prompt(self, pieces: PromptPieces, observation: str) -> PromptIds:
        """Strategy prompt (docs/method.md §3.2): role, task, first observation, actions, and the
        request for an ordered plan inside <strategy></strategy>, no action."""
        prefix = self.prefix_text(pieces)

        def render(obs: str, h: int) -> PromptIds:
            return self._make(prefix, f"Current observation: {obs}\n" + self.actions_text(pieces)
                              + self.strategy_instruction)

        return self._fit(render, observation, 0)

    def judge_prompt(self, pieces: PromptPieces, strategy: str | None,
                     steps: Sequence[HistoryEntry]) -> PromptIds:
        """Self-judgment prompt (docs/method.md §3.3): task, strategy, the numbered (observation,
        action) steps, each observation cut to ``judge_obs_chars`` (halved until the budget
        holds), the two questions and the answer format. The final reward is not shown.

        Raises ValueError when even observation-free steps exceed the budget."""
        if not steps:
            raise ValueError("judge_prompt needs at least one step")
        prefix = self.prefix_text(pieces, strategy)
        chars = self.judge_obs_chars
        while True:
            body = f"Here is the trajectory you played ({len(steps)} steps):\n"
            for i, e in enumerate(steps, start=1):
                obs = " ".join(e.observation.split())
                if len(obs) > chars:
                    obs = obs[:chars] + " ..."
                body += f"Step {i} observation: {obs}\nStep {i} action: {e.action}\n"
            p = self._make(prefix, body + JUDGE_INSTRUCTION)
            if p.num_tokens <= self.max_prompt_tokens:
                return p
            if chars == 0:
                raise ValueError(f"judge prompt of {len(steps)} steps exceeds max_prompt_tokens="
                                 f"{self.max_prompt_tokens}; raise env.max_prompt_tokens")
            chars //= 2
