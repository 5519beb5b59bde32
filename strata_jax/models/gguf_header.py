"""A GGUF file's header, read safely: the pre-scan and its bounds, the reference reader's parse.

`check_header` walks the header (metadata table and tensor table) with plain struct reads and
refuses a malformed or hostile file (counts past the end of the file or above the bounds
below, an unknown type, no ``general.architecture`` of a ported model) before the ``gguf``
package's reader, which trusts every count and builds a Python object per metadata array item
in its constructor, sees it. `open_gguf` runs that check and then the reader (cached per file),
and `metadata_field` / `architecture` read its metadata with one error for a missing key.

Format: llama.cpp ``gguf-py/gguf/gguf_reader.py`` (the layout the reader parses: magic, version,
tensor and metadata counts, typed key/value entries, tensor infos, aligned data) and
``gguf-py/gguf/constants.py`` (``GGUFValueType``, ``GGML_QUANT_SIZES``).
"""
from __future__ import annotations

import functools
import mmap
import os
import struct
from typing import Any

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURES = ("qwen2",)


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


def metadata_field(reader: Any, key: str, default: Any = None, required: bool = True) -> Any:
    """The value of metadata `key` in a parsed reader (`open_gguf`): ``field.contents()``, a
    Python scalar, str or list; `default` when absent.

    Raises GGUFError naming the file and the key when it is absent, `required` and `default` is
    None.
    """
    f = reader.fields.get(key)
    if f is None:
        if required and default is None:
            raise GGUFError(f"{reader.data.filename}: GGUF metadata lacks {key!r}, which a Qwen2 "
                             "model needs; the file was not written by a Qwen2 converter")
        return default
    return f.contents()


def architecture(reader: Any) -> str:
    """The ``general.architecture`` of a parsed reader, one of SUPPORTED_ARCHITECTURES.

    Raises GGUFError when it is missing or another architecture.
    """
    arch = metadata_field(reader, "general.architecture")
    check_architecture(reader.data.filename, arch)   # `check_header` did; kept for any reader
    return arch
