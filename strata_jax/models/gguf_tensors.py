"""A GGUF file's tensors as HF Qwen2 tensors: llama.cpp names mapped to HF names, each tensor
read with plain file reads at its offset and dequantized to float32 on demand.

`gguf_tensors` gives ``{HF tensor name: GGUFTensorRef}``, the interface of the safetensors
`loading.TensorRef` (``.shape`` in HF's ``[out, in]`` orientation, ``.read()`` -> a float32
host array, dequantized with ``gguf.quants``), so `loading.load_params` places them one at a
time. Reads bypass the reader's memory map, so loaded pages do not stay resident.

Tensor names: the weight table (`strata_jax.models.weights`). Qwen2's q/k weights are stored
unpermuted (llama.cpp's converter permutes only LLaMA-style rotary layouts), so no inverse
permutation is applied; the transformers parity tests pin that.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from strata_jax.models.gguf_header import GGUFError, architecture, open_gguf
from strata_jax.models.weights import gguf_name_to_hf

# Precomputed RoPE frequencies some converters add; the port computes its own from rope_theta.
_IGNORED = ("rope_freqs.weight",)


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

    Names map through the weight table (`weights.gguf_name_to_hf`). Raises GGUFError (a
    ValueError) for another architecture or a tensor name the Qwen2 port does not know (named
    in the message). ``rope_freqs.weight`` is ignored (the port computes RoPE itself).
    """
    reader = open_gguf(path)
    architecture(reader)
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
