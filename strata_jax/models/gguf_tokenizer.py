"""A GGUF file's own tokenizer as a transformers fast tokenizer (the ``tokenizers`` library,
no torch): byte-level BPE from ``tokenizer.ggml.tokens`` / ``merges`` / ``token_type``, the
Qwen2 pre-tokenizer, control tokens as special added tokens, eos / pad from the file's ids and
its chat template.

Keys: llama.cpp ``gguf-py/gguf/constants.py`` (``Keys.Tokenizer``, ``TokenType``) and
``src/llama-vocab.cpp`` (LLAMA_VOCAB_PRE_TYPE_QWEN2's split regex).
"""
from __future__ import annotations

import functools
import os
from typing import Any

from strata_jax.models.chat_template import QWEN25_CHAT_TEMPLATE
from strata_jax.models.gguf_header import GGUFError, metadata_field, open_gguf

# Pre-tokenizer of each llama.cpp ``tokenizer.ggml.pre`` value the port supports. Qwen2's split
# regex is the one in Qwen2.5's tokenizer.json (and llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2).
_PRE_TOKENIZERS = {
    "qwen2": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
              r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4  # gguf.TokenType


def _strings(reader: Any, key: str) -> list[str]:
    f = reader.fields[key]
    return [bytes(f.parts[i]).decode("utf-8") for i in f.data]


@functools.lru_cache(maxsize=2)
def _gguf_tokenizer(path: str, size: int, mtime_ns: int) -> Any:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    reader = open_gguf(path)
    file = reader.data.filename
    kind = metadata_field(reader, "tokenizer.ggml.model")
    pre = metadata_field(reader, "tokenizer.ggml.pre", "default", required=False)
    if kind != "gpt2" or pre not in _PRE_TOKENIZERS:
        raise GGUFError(f"{file}: tokenizer {kind!r} / pre-tokenizer {pre!r} is not the Qwen2 "
                         "byte-level BPE (gpt2 / qwen2); pass --config.model.tokenizer=offline to "
                         "use the shipped Qwen2.5 tokenizer instead")
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"):
        if key not in reader.fields:
            raise GGUFError(f"{file}: GGUF metadata lacks {key!r}, so the file's tokenizer cannot "
                             "be built; pass --config.model.tokenizer=offline to use the shipped "
                             "Qwen2.5 tokenizer instead")
    tokens = _strings(reader, "tokenizer.ggml.tokens")
    types = reader.fields["tokenizer.ggml.token_type"]
    types = [int(types.parts[i][0]) for i in types.data]
    merges = [tuple(m.split(" ", 1)) for m in _strings(reader, "tokenizer.ggml.merges")]
    # Added tokens sit in the vocabulary at their file ids too, so `add_tokens` below keeps those
    # ids instead of appending (the file may place them anywhere, not only after the BPE rows).
    vocab = {t: i for i, (t, ty) in enumerate(zip(tokens, types))
             if ty in (_NORMAL, _CONTROL, _USER_DEFINED)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                               ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_PRE_TOKENIZERS[pre]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # Control tokens (<|im_start|>, ...) are special; user-defined ones (<tool_call>) are plain
    # added tokens; unused ([PAD151665] ...) rows of a padded embedding get no token at all.
    added = [AddedToken(t, special=ty == _CONTROL, normalized=False)
             for t, ty in zip(tokens, types) if ty in (_CONTROL, _USER_DEFINED)]
    tok.add_tokens(added)

    def token(key: str) -> str | None:
        i = metadata_field(reader, key, -1, required=False)
        return tokens[int(i)] if 0 <= int(i) < len(tokens) else None

    template = metadata_field(reader, "tokenizer.chat_template", "", required=False)
    if not template:
        template = QWEN25_CHAT_TEMPLATE
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=token("tokenizer.ggml.eos_token_id"),
        pad_token=token("tokenizer.ggml.padding_token_id"),
        bos_token=None,  # Qwen2 adds no BOS (tokenizer.ggml.add_bos_token is false)
        chat_template=template, clean_up_tokenization_spaces=False,
        model_max_length=int(metadata_field(reader, "qwen2.context_length", 32768, required=False)))


def gguf_tokenizer(path: str) -> Any:
    """A transformers fast tokenizer built from a GGUF file's own tokenizer metadata.

    Byte-level BPE from ``tokenizer.ggml.tokens`` / ``merges`` / ``token_type`` with the Qwen2
    pre-tokenizer; control tokens become special added tokens; eos / pad from the file's ids; the
    file's ``tokenizer.chat_template`` (the Qwen2.5 template when absent). Built with the
    ``tokenizers`` library, no torch. Cached per file: do not mutate it.

    Raises GGUFError (a ValueError) when the file's tokenizer is not Qwen2's byte-level BPE.
    """
    st = os.stat(path)
    return _gguf_tokenizer(os.path.realpath(path), st.st_size, st.st_mtime_ns)
