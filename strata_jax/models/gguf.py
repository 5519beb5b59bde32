"""GGUF checkpoints (llama.cpp's single-file format) as a Qwen2 model source.

A ``*.gguf`` file carries everything a run needs: the architecture's hyper-parameters, every
weight tensor (often block-quantized: Q4_K, Q5_0, Q6_K, Q8_0, ...), and the tokenizer (BPE
tokens, merges, token types, special ids, chat template). This module reads the file with the
``gguf`` package (the format's reference Python reader, maintained with llama.cpp) and maps it onto
what the rest of the project already uses for HF checkpoints:

  * `gguf_config` -> `Qwen2Config` from the ``qwen2.*`` metadata (every field checked);
  * `gguf_tensors` -> ``{HF tensor name: GGUFTensorRef}``, the same interface as the safetensors
    `TensorRef` (``.shape`` in HF's ``[out, in]`` orientation, ``.read()`` -> a float32 host array,
    dequantized with ``gguf.quants``), so `loading.load_params` places them one at a time;
  * `gguf_tokenizer` -> a transformers fast tokenizer built from the file's own vocabulary,
    merges, special tokens and chat template (the ``tokenizers`` library, no torch).

Quantized weights are dequantized to float32 once at load: the port computes in fp32/bf16, and a
fine-tuned policy is exported as HF safetensors (`loading.export_params`), which transformers and
vLLM serve. Tensors are read with plain file reads at their offsets rather than through the
reader's memory map, so loaded pages do not stay resident.

Tensor names and metadata keys: llama.cpp ``gguf-py/gguf/constants.py`` (MODEL_ARCH.QWEN2,
``TENSOR_NAMES``, ``Keys``) and ``src/llama-model.cpp`` (defaults for optional keys). Qwen2's
q/k weights are stored unpermuted (llama.cpp's converter permutes only LLaMA-style rotary
layouts), so no inverse permutation is applied; the transformers parity tests pin that.
"""
from __future__ import annotations

import dataclasses
import functools
import mmap
import os
import re
import struct
from typing import Any

import numpy as np

from strata_jax.models.chat_template import QWEN25_CHAT_TEMPLATE
from strata_jax.models.config import Qwen2Config

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURES = ("qwen2",)

# llama.cpp tensor names -> HF Qwen2 names ("{i}" is the layer index).
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
# Precomputed RoPE frequencies some converters add; the port computes its own from rope_theta.
_IGNORED = ("rope_freqs.weight",)


class GGUFError(ValueError):
    """A GGUF file that cannot be used as a Qwen2 model (malformed, hostile, another
    architecture, a missing or inconsistent key); the message names the file and what to do."""


# Bounds the header pre-scan (`check_header`) and `gguf_config` enforce before anything is
# parsed or built. They are far above any Qwen2 / Qwen2.5 release (the largest has 80 layers,
# 64 query heads, hidden 8192, a 151,936-row vocabulary, 32k-token context without RoPE
# scaling), and far below what makes the reference reader or the model builder hang: the reader
# creates a Python object per array item and the builder a dict entry per layer.
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_HIDDEN = 1 << 16
MAX_VOCAB = 1 << 18             # tokenizer arrays (tokens, token types, scores, merges)
MAX_CONTEXT = 1 << 20
MAX_ARRAY_ITEMS = 1 << 16       # any other metadata array
# All metadata arrays together. A Qwen2.5 file carries three tokenizer arrays of about 152k
# items each (tokens, token types, merges) and little else, well under half of this; many
# arrays each under the bounds above must not add up to what keeps the reader busy for minutes.
MAX_METADATA_ITEMS = 1 << 20
MAX_KV = 1 << 16                # metadata entries (a real file has a few dozen)
MAX_TENSORS = 16 * MAX_LAYERS + 16
MAX_DIMS = 4                    # GGML_MAX_DIMS
_VERSIONS = (2, 3)              # the reference reader's READER_SUPPORTED_VERSIONS

# GGUFValueType -> (struct code, bytes); STRING = 8 and ARRAY = 9 are variable-sized.
_SCALARS = {0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4),
            6: ("f", 4), 7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8)}
_STRING, _ARRAY = 8, 9


def check_header(path: str) -> None:
    """Pre-scan a GGUF file's header, metadata and tensor table without building anything.

    Every count and length is checked against the bytes left in the file and against the
    bounds above (metadata entries <= MAX_KV, tensors <= MAX_TENSORS, tokenizer arrays <=
    MAX_VOCAB items, other arrays <= MAX_ARRAY_ITEMS, all arrays together <=
    MAX_METADATA_ITEMS, no nested arrays, tensors of 1 to MAX_DIMS dims of a known storage type
    whose data lies inside the file), and ``general.architecture`` must be a string naming one
    of SUPPORTED_ARCHITECTURES, before the reference reader, which parses everything in its
    constructor (an object per array item) and trusts the counts, sees the file. A hostile
    count is refused after reading a few bytes, and at most MAX_METADATA_ITEMS array items are
    walked before a refusal; a real Qwen2 file is walked once (its string arrays item by item,
    a fraction of the reader's own parse time).

    Raises GGUFError naming the file, the offending entry and the bound (or the missing or
    unsupported architecture).
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size = os.path.getsize(path)
    if size < 24:
        raise GGUFError(f"{path} is not a readable GGUF file: truncated ({size} bytes; a "
                        "GGUF header alone has 24); re-download it")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != GGUF_MAGIC:
            raise GGUFError(f"{path} does not start with the GGUF magic bytes: not a GGUF file")
        version = struct.unpack_from("<I", buf, 4)[0]
        end = "<" if version & 0xFFFF else ">"   # the reader's byte-order test
        if end == ">":
            version = struct.unpack_from(">I", buf, 4)[0]
        if version not in _VERSIONS:
            raise GGUFError(f"{path}: GGUF version {version} is not supported (versions "
                            f"{_VERSIONS}); convert the model with a current llama.cpp")
        n_tensors, n_kv = struct.unpack_from(end + "QQ", buf, 8)
        pos = 24

        def bad(what: str) -> GGUFError:
            return GGUFError(f"{path} is not a readable GGUF file (malformed or hostile): "
                             f"{what}; re-download or re-convert it")

        def unpack(code: str, n: int) -> Any:
            nonlocal pos
            if pos + n > size:
                raise bad(f"it ends inside the entry at byte {pos}")
            v = struct.unpack_from(end + code, buf, pos)[0]
            pos += n
            return v

        def string(what: str) -> bytes:
            nonlocal pos
            n = unpack("Q", 8)
            if n > size - pos:
                raise bad(f"{what} declares {n} bytes, {size - pos} are left in the file")
            pos += n
            return buf[pos - n:pos]

        def count(n: int, item: int, limit: int, what: str) -> None:
            if n > limit:
                raise bad(f"{what} declares {n} items (at most {limit} are accepted)")
            if n * item > size - pos:
                raise bad(f"{what} declares {n} items of >= {item} bytes, {size - pos} bytes "
                          "are left in the file")

        count(n_kv, 13, MAX_KV, "the metadata table")
        alignment = 32
        arch: Any = None            # general.architecture: its value, or its type if no string
        items = 0                   # array items so far, against MAX_METADATA_ITEMS
        for _ in range(n_kv):
            key = string("a metadata key").decode("utf-8", "replace")
            kind = unpack("I", 4)
            if kind in _SCALARS:
                value = unpack(*_SCALARS[kind])
                if key == "general.alignment":
                    alignment = value
            elif kind == _STRING:
                value = string(f"metadata {key!r}")
            elif kind == _ARRAY:
                item = unpack("I", 4)
                n = unpack("Q", 8)
                limit = MAX_VOCAB if key.startswith("tokenizer.") else MAX_ARRAY_ITEMS
                items += n
                # (an array over its own bound is named by `count` below)
                if items > MAX_METADATA_ITEMS and n <= limit:
                    raise bad(f"metadata array {key!r} brings the metadata arrays to {items} "
                              f"items (at most {MAX_METADATA_ITEMS} in all are accepted)")
                if item in _SCALARS:
                    count(n, _SCALARS[item][1], limit, f"metadata array {key!r}")
                    pos += n * _SCALARS[item][1]
                elif item == _STRING:
                    count(n, 8, limit, f"metadata array {key!r}")
                    for _ in range(n):
                        ln = struct.unpack_from(end + "Q", buf, pos)[0] if pos + 8 <= size \
                            else size
                        if ln > size - pos - 8:
                            raise bad(f"a string of metadata array {key!r} runs past the end "
                                      "of the file")
                        pos += 8 + ln
                else:
                    raise bad(f"metadata array {key!r} has items of type {item} (nested arrays "
                              "and unknown types are refused)")
            else:
                raise bad(f"metadata {key!r} has unknown value type {kind}")
            if key == "general.architecture":
                arch = value.decode("utf-8", "replace") if kind == _STRING else kind
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1 or \
                alignment & (alignment - 1) or alignment > 1 << 16:
            raise bad(f"general.alignment is {alignment!r} (a power of two up to 65536)")
        count(n_tensors, 28, MAX_TENSORS, "the tensor table")
        tensors = []
        for _ in range(n_tensors):
            name = string("a tensor name").decode("utf-8", "replace")
            n_dims = unpack("I", 4)
            if not 1 <= n_dims <= MAX_DIMS:
                raise bad(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS})")
            dims = [unpack("Q", 8) for _ in range(n_dims)]
            qtype = unpack("I", 4)
            offset = unpack("Q", 8)
            try:
                block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
            except (ValueError, KeyError):
                raise bad(f"tensor {name!r} has unknown storage type {qtype}") from None
            if min(dims) < 1 or dims[0] % block:
                raise bad(f"tensor {name!r} has shape {dims} (positive, the first a multiple "
                          f"of {block})")
            n_bytes = block_bytes
            for d in dims:
                n_bytes *= d
                if n_bytes > size * block:   # stop before the product grows without bound
                    raise bad(f"tensor {name!r} of shape {dims} is larger than the file")
            tensors.append((name, offset, n_bytes // block))
        data = pos + (-pos) % alignment
        for name, offset, n_bytes in tensors:
            if data + offset + n_bytes > size:
                raise bad(f"tensor {name!r} ({n_bytes} bytes at offset {offset}) lies past "
                          f"the end of the file ({size} bytes): truncated")
    check_architecture(path, arch)


def check_architecture(path: str, arch: Any) -> None:
    """Refuse a file whose ``general.architecture`` (`arch`: the string, the value type of a
    non-string entry, or None when the key is absent) is not one of SUPPORTED_ARCHITECTURES.

    Raises GGUFError naming the file and what to use instead.
    """
    if arch is None:
        raise GGUFError(f"{path}: GGUF metadata has no 'general.architecture', so it is not a "
                        "model file written by llama.cpp's converter; use a Qwen2 / Qwen2.5 "
                        "GGUF (python -m strata_jax.models.fetch --list names some)")
    if not isinstance(arch, str):
        raise GGUFError(f"{path}: GGUF metadata 'general.architecture' has value type {arch} "
                        "(a string is required): a damaged or hostile file; re-download or "
                        "re-convert it")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{path}: GGUF architecture {arch!r} is not supported; strata-jax "
                        f"ports {', '.join(SUPPORTED_ARCHITECTURES)} (Qwen2 / Qwen2.5) models "
                        "only")


def is_gguf(path: str) -> bool:
    """True when `path` is a file that starts with the GGUF magic bytes."""
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def gguf_name_to_hf(name: str) -> str | None:
    """HF Qwen2 tensor name of a llama.cpp tensor name (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``); None for names the port does not use."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = _BLOCK_RE.match(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


@functools.lru_cache(maxsize=2)
def _reader(path: str, size: int, mtime_ns: int) -> Any:
    # Parsing the metadata of a Qwen vocabulary (152k token strings) takes seconds; config,
    # params and tokenizer of one run read the same file, so the parsed reader is shared.
    import gguf
    check_header(path)   # hostile counts would make the reader run for hours
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # truncated, wrong version, garbled header: one message
        raise GGUFError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); "
                         "re-download it (python -m strata_jax.models.fetch verifies the "
                         "checksum)") from e


def open_gguf(path: str) -> Any:
    """The parsed ``gguf.GGUFReader`` of `path` (cached per path, size and mtime).

    Raises FileNotFoundError when `path` is missing and GGUFError (a ValueError) when it is not
    a usable GGUF file (`check_header` runs first).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    if not is_gguf(path):
        raise GGUFError(f"{path} does not start with the GGUF magic bytes: not a GGUF file")
    st = os.stat(path)
    return _reader(os.path.realpath(path), st.st_size, st.st_mtime_ns)


def _field(reader: Any, key: str, default: Any = None, required: bool = True) -> Any:
    f = reader.fields.get(key)
    if f is None:
        if required and default is None:
            raise GGUFError(f"{reader.data.filename}: GGUF metadata lacks {key!r}, which a Qwen2 "
                             "model needs; the file was not written by a Qwen2 converter")
        return default
    return f.contents()


def _arch(reader: Any) -> str:
    arch = _field(reader, "general.architecture")
    check_architecture(reader.data.filename, arch)   # `check_header` did; kept for any reader
    return arch


def _positive_int(v: Any, key: str, file: str, limit: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) < 1:
        raise GGUFError(f"{file}: GGUF metadata {key!r} must be a positive integer, got {v!r}")
    if limit is not None and int(v) > limit:
        raise GGUFError(f"{file}: GGUF metadata {key!r} is {int(v)}, above the {limit} a Qwen2 "
                        "model can have: a damaged or hostile file; re-download or re-convert it")
    return int(v)


def _agree(file: str, key: str, value: int, tensor: str, found: int) -> None:
    if value != found:
        raise GGUFError(f"{file}: GGUF metadata {key!r} is {value} but tensor {tensor!r} says "
                        f"{found}: an inconsistent file; re-download or re-convert it")


def gguf_config(path: str) -> Qwen2Config:
    """`Qwen2Config` from a GGUF file's ``qwen2.*`` metadata.

    Keys read (llama.cpp ``LLM_KV_*``): block_count, embedding_length, feed_forward_length,
    attention.head_count, attention.head_count_kv (default: head_count, as llama.cpp),
    attention.key_length / value_length (default: embedding_length / head_count; must agree),
    rope.freq_base (default 10000, as llama.cpp), attention.layer_norm_rms_epsilon,
    context_length. vocab_size is the embedding's row count; the LM head is tied when the file
    has no ``output.weight`` (llama.cpp's rule).

    Every size is bounded (layers <= MAX_LAYERS, heads <= MAX_HEADS, hidden width <=
    MAX_HIDDEN, feed-forward width <= 8 * MAX_HIDDEN, vocabulary <= MAX_VOCAB, context <=
    MAX_CONTEXT) and checked against the tensors the file
    holds (block_count = the ``blk.<i>`` layers present, embedding_length = the embedding's
    width, head counts x key_length = layer 0's q / k widths, feed_forward_length = its
    ffn_up width), so a hostile key cannot make the model builder allocate without bound.

    Raises:
      GGUFError (a ValueError): another architecture, a missing, malformed, out-of-bounds or
        inconsistent key, RoPE scaling (YaRN / linear: not ported), or key_length !=
        value_length.
    """
    reader = open_gguf(path)
    arch = _arch(reader)
    file = reader.data.filename

    def get(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    scaling = _field(reader, f"{arch}.rope.scaling.type", "none", required=False)
    if scaling not in ("none", ""):
        raise GGUFError(f"{file}: RoPE scaling {scaling!r} is not supported by the Qwen2 port "
                         "(it implements plain RoPE with rope.freq_base)")
    hidden = _positive_int(get("embedding_length"), f"{arch}.embedding_length", file,
                           MAX_HIDDEN)
    heads = _positive_int(get("attention.head_count"), f"{arch}.attention.head_count", file,
                          MAX_HEADS)
    kv_heads = _positive_int(get("attention.head_count_kv", heads),
                             f"{arch}.attention.head_count_kv", file, MAX_HEADS)
    key_len = _positive_int(get("attention.key_length", hidden // heads),
                            f"{arch}.attention.key_length", file, MAX_HIDDEN)
    value_len = _positive_int(get("attention.value_length", key_len),
                              f"{arch}.attention.value_length", file, MAX_HIDDEN)
    if key_len != value_len:
        raise GGUFError(f"{file}: key_length {key_len} != value_length {value_len}; Qwen2 uses "
                         "one head width")
    layers = _positive_int(get("block_count"), f"{arch}.block_count", file, MAX_LAYERS)
    ffn = _positive_int(get("feed_forward_length"), f"{arch}.feed_forward_length", file,
                        8 * MAX_HIDDEN)
    context = _positive_int(get("context_length"), f"{arch}.context_length", file, MAX_CONTEXT)
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{file}: no token_embd.weight tensor; not a Qwen2 model file")
    # GGUF shapes are [in, out]: the embedding is [D, V], a projection [D_in, D_out].
    width = lambda name: [int(d) for d in tensors[name].shape]  # noqa: E731
    vocab = width("token_embd.weight")[-1]
    if vocab > MAX_VOCAB:
        raise GGUFError(f"{file}: token_embd.weight has {vocab} rows, above the {MAX_VOCAB} a "
                        "Qwen2 vocabulary can have: a damaged or hostile file; re-download or "
                        "re-convert it")
    _agree(file, f"{arch}.embedding_length", hidden, "token_embd.weight",
           width("token_embd.weight")[0])
    present = {int(m.group(1)) for m in map(_BLOCK_RE.match, tensors) if m}
    if present != set(range(len(present))) or len(present) != layers:
        raise GGUFError(f"{file}: GGUF metadata '{arch}.block_count' is {layers} but the file "
                        f"holds tensors of {len(present)} layers"
                        f"{'' if present == set(range(len(present))) else ' (not numbered 0..n-1)'}"
                        ": an inconsistent file; re-download or re-convert it")
    for name, key, value in (("blk.0.attn_q.weight", "attention.head_count", heads * key_len),
                             ("blk.0.attn_k.weight", "attention.head_count_kv",
                              kv_heads * key_len),
                             ("blk.0.ffn_up.weight", "feed_forward_length", ffn)):
        if name in tensors:
            _agree(file, f"{arch}.{key}" + (" x key_length" if "head" in key else ""), value,
                   name, width(name)[-1])
    theta = get("rope.freq_base", 10000.0)
    eps = get("attention.layer_norm_rms_epsilon")
    for key, v in (("rope.freq_base", theta), ("attention.layer_norm_rms_epsilon", eps)):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.floating)):
            raise GGUFError(f"{file}: GGUF metadata '{arch}.{key}' must be a number, got {v!r}")
    try:
        return Qwen2Config(
            vocab_size=vocab, hidden_size=hidden,
            intermediate_size=ffn, num_layers=layers,
            num_heads=heads, num_kv_heads=kv_heads, head_dim=key_len,
            # float32 metadata: 1e-6 is stored as 9.99999997e-07; round to float32 precision.
            rope_theta=float(np.float32(theta)), rms_norm_eps=float(f"{np.float32(eps):.7g}"),
            tie_word_embeddings="output.weight" not in tensors,
            max_position_embeddings=context)
    except ValueError as e:
        raise GGUFError(f"{file}: {e}") from e


@dataclasses.dataclass(frozen=True)
class GGUFTensorRef:
    """One tensor of a GGUF file, read and dequantized on demand.

    Attributes:
      file: the GGUF path. name: the llama.cpp tensor name. offset / n_bytes: absolute byte range
      of the stored data. qtype: ``gguf.GGMLQuantizationType``. stored_shape: numpy shape of the
      stored data (rows, bytes per row for block-quantized types). shape: the dequantized shape in
      HF orientation (``[out, in]`` for matrices: GGUF lists dimensions innermost first).
    """

    file: str
    name: str
    offset: int
    n_bytes: int
    qtype: Any
    stored_shape: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def dtype(self) -> np.dtype:
        """float32: every stored type is dequantized / widened to it."""
        return np.dtype(np.float32)

    def read(self) -> np.ndarray:
        """The tensor as a fresh float32 host array of `shape` (plain reads, no mmap)."""
        from gguf import GGMLQuantizationType, quants
        raw = np.fromfile(self.file, dtype=np.uint8, count=self.n_bytes, offset=self.offset)
        if raw.size != self.n_bytes:
            raise GGUFError(f"{self.file}: tensor {self.name!r} is truncated ({raw.size} of "
                             f"{self.n_bytes} bytes); re-download the file")
        if self.qtype == GGMLQuantizationType.F32:
            out = raw.view(np.float32)
        elif self.qtype == GGMLQuantizationType.F16:
            out = raw.view(np.float16).astype(np.float32)
        else:
            try:
                out = quants.dequantize(raw.reshape(self.stored_shape), self.qtype)
            except NotImplementedError:
                raise GGUFError(f"{self.file}: tensor {self.name!r} uses quantization "
                                 f"{self.qtype.name}, which the gguf package cannot dequantize; "
                                 "convert the model with another quantization") from None
        return np.ascontiguousarray(out, dtype=np.float32).reshape(self.shape)


def gguf_tensors(path: str) -> dict[str, GGUFTensorRef]:
    """``{HF Qwen2 tensor name: GGUFTensorRef}`` of every weight in a GGUF file.

    Raises GGUFError (a ValueError) for another architecture or a tensor name the Qwen2 port does not know
    (named in the message). ``rope_freqs.weight`` is ignored (the port computes RoPE itself).
    """
    reader = open_gguf(path)
    _arch(reader)
    out: dict[str, GGUFTensorRef] = {}
    for t in reader.tensors:
        if t.name in _IGNORED:
            continue
        hf = gguf_name_to_hf(t.name)
        if hf is None:
            raise GGUFError(f"{path}: GGUF tensor {t.name!r} has no place in the Qwen2 port")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        out[hf] = GGUFTensorRef(file=path, name=t.name, offset=int(t.data_offset),
                                n_bytes=int(t.n_bytes), qtype=t.tensor_type,
                                stored_shape=tuple(int(d) for d in t.data.shape), shape=shape)
    return out


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
    kind = _field(reader, "tokenizer.ggml.model")
    pre = _field(reader, "tokenizer.ggml.pre", "default", required=False)
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
        i = _field(reader, key, -1, required=False)
        return tokens[int(i)] if 0 <= int(i) < len(tokens) else None

    template = _field(reader, "tokenizer.chat_template", "", required=False)
    if not template:
        template = QWEN25_CHAT_TEMPLATE
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=token("tokenizer.ggml.eos_token_id"),
        pad_token=token("tokenizer.ggml.padding_token_id"),
        bos_token=None,  # Qwen2 adds no BOS (tokenizer.ggml.add_bos_token is false)
        chat_template=template, clean_up_tokenization_spaces=False,
        model_max_length=int(_field(reader, "qwen2.context_length", 32768, required=False)))


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
