"""The Qwen2 port's weights: one table from which every tensor's params-tree path, HF
(transformers / safetensors) name and llama.cpp (GGUF) name derive.

Each row of `WEIGHTS` is a `Weight`: the params key (the top-level key, or the key inside a
layer's dict), the HF name and the GGUF name; a per-layer row carries ``{i}`` (the layer index)
in both names. Loading and export (`loading.load_params`, `loading.export_params`) and the GGUF
reader (`gguf_tensors`, `gguf.gguf_config`) go through this table only, so a new weight is
added here once, plus its shape and logical axes in `qwen2.py` (tests/models/test_loading.py checks
that the two list the same keys).

Sources: transformers ``modeling_qwen2.py`` (Qwen2ForCausalLM state-dict names) and llama.cpp
``gguf-py/gguf/constants.py`` (MODEL_ARCH.QWEN2's ``TENSOR_NAMES``); tests/models/test_gguf.py checks
every row against the ``gguf`` package's own HF -> GGUF name map (``tensor_mapping.py``).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Iterator


@dataclasses.dataclass(frozen=True)
class Weight:
    """One tensor of the model.

    Attributes:
      key: params-tree key: ``params[key]`` for a top-level weight, ``params["layers"][i][key]``
        for a per-layer one.
      hf: HF name, ``{i}`` for the layer index (``model.layers.{i}.self_attn.q_proj.weight``).
      gguf: llama.cpp name, ``{i}`` likewise (``blk.{i}.attn_q.weight``).
      tied_away: absent from the params and the checkpoint when the config ties the word
        embeddings (the LM head reuses the embedding).
    """

    key: str
    hf: str
    gguf: str
    tied_away: bool = False

    @property
    def per_layer(self) -> bool:
        """True for a weight every decoder layer has (its names carry ``{i}``)."""
        return "{i}" in self.hf

    def path(self, layer: int | None = None) -> tuple:
        """Params-tree path: ``(key,)``, or ``("layers", layer, key)`` for a per-layer weight."""
        return ("layers", layer, self.key) if self.per_layer else (self.key,)


# Checkpoint order: export writes the tensors in this order, the layer rows layer by layer.
WEIGHTS: tuple[Weight, ...] = (
    Weight("embed", "model.embed_tokens.weight", "token_embd.weight"),
    Weight("input_norm", "model.layers.{i}.input_layernorm.weight", "blk.{i}.attn_norm.weight"),
    Weight("q_proj", "model.layers.{i}.self_attn.q_proj.weight", "blk.{i}.attn_q.weight"),
    Weight("q_bias", "model.layers.{i}.self_attn.q_proj.bias", "blk.{i}.attn_q.bias"),
    Weight("k_proj", "model.layers.{i}.self_attn.k_proj.weight", "blk.{i}.attn_k.weight"),
    Weight("k_bias", "model.layers.{i}.self_attn.k_proj.bias", "blk.{i}.attn_k.bias"),
    Weight("v_proj", "model.layers.{i}.self_attn.v_proj.weight", "blk.{i}.attn_v.weight"),
    Weight("v_bias", "model.layers.{i}.self_attn.v_proj.bias", "blk.{i}.attn_v.bias"),
    Weight("o_proj", "model.layers.{i}.self_attn.o_proj.weight", "blk.{i}.attn_output.weight"),
    Weight("post_norm", "model.layers.{i}.post_attention_layernorm.weight",
           "blk.{i}.ffn_norm.weight"),
    Weight("gate_proj", "model.layers.{i}.mlp.gate_proj.weight", "blk.{i}.ffn_gate.weight"),
    Weight("up_proj", "model.layers.{i}.mlp.up_proj.weight", "blk.{i}.ffn_up.weight"),
    Weight("down_proj", "model.layers.{i}.mlp.down_proj.weight", "blk.{i}.ffn_down.weight"),
    Weight("final_norm", "model.norm.weight", "output_norm.weight"),
    Weight("lm_head", "lm_head.weight", "output.weight", tied_away=True),
)
LAYER_WEIGHTS: tuple[Weight, ...] = tuple(w for w in WEIGHTS if w.per_layer)
TOP_WEIGHTS: tuple[Weight, ...] = tuple(w for w in WEIGHTS if not w.per_layer)

_BY_KEY = {w.key: w for w in WEIGHTS}
_BY_HF = {w.hf: w for w in WEIGHTS}
_BY_GGUF = {w.gguf: w for w in WEIGHTS}
# The layer index of a concrete name: "model.layers.<i>." (HF) or "blk.<i>." (GGUF).
_LAYER_INDEX = re.compile(r"^(?:model\.layers|blk)\.(\d+)\.")
_GGUF_BLOCK = re.compile(r"^blk\.(\d+)\.")


def _template(name: str) -> tuple[str, int | None]:
    """(the name with its layer index replaced by ``{i}``, the index or None)."""
    m = _LAYER_INDEX.match(name)
    if not m:
        return name, None
    return name[:m.start(1)] + "{i}" + name[m.end(1):], int(m.group(1))


def _lookup(name: str, table: dict[str, Weight]) -> tuple[Weight, int | None] | None:
    template, layer = _template(name)
    w = table.get(template)
    return None if w is None else (w, layer)


def hf_name_to_path(name: str) -> tuple | None:
    """Params-tree path of an HF tensor name (``model.layers.3.self_attn.q_proj.weight`` ->
    ``("layers", 3, "q_proj")``, ``model.norm.weight`` -> ``("final_norm",)``); None for a name
    the port has no weight for."""
    found = _lookup(name, _BY_HF)
    return None if found is None else found[0].path(found[1])


def path_to_hf_name(path: tuple) -> str:
    """HF tensor name of a params-tree path (the inverse of `hf_name_to_path`).

    Raises KeyError for a path that names no weight.
    """
    if path[0] == "layers":
        return _BY_KEY[path[2]].hf.format(i=path[1])
    return _BY_KEY[path[0]].hf


def gguf_name_to_hf(name: str) -> str | None:
    """HF Qwen2 tensor name of a llama.cpp tensor name (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``); None for names the port does not use."""
    found = _lookup(name, _BY_GGUF)
    if found is None:
        return None
    w, layer = found
    return w.hf.format(i=layer) if w.per_layer else w.hf


def gguf_name(key: str, layer: int | None = None) -> str:
    """llama.cpp tensor name of the weight with params key `key` (of layer `layer` for a
    per-layer weight): ``gguf_name("q_proj", 0)`` -> ``blk.0.attn_q.weight``.

    Raises KeyError for an unknown key.
    """
    w = _BY_KEY[key]
    return w.gguf.format(i=layer) if w.per_layer else w.gguf


def gguf_block_index(name: str) -> int | None:
    """Layer index of a llama.cpp per-layer tensor name (``blk.3.attn_q.weight`` -> 3); None
    for a top-level name."""
    m = _GGUF_BLOCK.match(name)
    return int(m.group(1)) if m else None


def checkpoint_names(num_layers: int, tie_word_embeddings: bool) -> Iterator[tuple[tuple, str]]:
    """(params-tree path, HF name) of every tensor of a checkpoint of the given shape, in
    `WEIGHTS` order with the per-layer rows repeated layer by layer (layer 0's rows, then
    layer 1's, ...), leaving out the `Weight.tied_away` rows of a tied model."""
    layers_done = False
    for w in WEIGHTS:
        if w.per_layer:
            if not layers_done:
                for i in range(num_layers):
                    for lw in LAYER_WEIGHTS:
                        yield lw.path(i), lw.hf.format(i=i)
                layers_done = True
        elif not (w.tied_away and tie_word_embeddings):
            yield w.path(), w.hf
