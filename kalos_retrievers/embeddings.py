"""Embeddings helpers: one interface over LangChain and LlamaIndex models (:class:`Embedder`),
and an offline lexical hashing embedder that needs no model and no network.

:class:`HashingEmbeddings` turns text into a fixed-size vector by hashing its words and
word bigrams into signed buckets (the "hashing trick"), weighting each feature by a
sublinear term frequency, and normalizing to unit length. Texts that share words get
similar vectors; texts that share none are nearly orthogonal. Words are runs of letters,
digits and combining marks in any script, case-folded and composed ("Müller" is one word in
either Unicode form, "straße" and "STRASSE" the same); in Chinese and Japanese, written
without spaces, each Han or kana character is a feature and adjacent pairs are its bigrams.
(Until session 45 only ASCII letters and digits were read: vectors of other text stored with
an earlier version differ from this one's, and such rows need embedding again.) It is deterministic across
processes and machines (BLAKE2b, not Python's salted ``hash``), so vectors stored by one
process are found by another.

It is what Kalos's examples and tests use when no real model is installed: good enough to
find "the passage that mentions the refund window" for a question about refunds, blind to
synonyms and paraphrase. For semantic recall install a real model (the examples use
all-MiniLM-L6-v2 from the ``embeddings`` extra) or pass any LangChain ``Embeddings``.

It implements LangChain's ``Embeddings`` interface, so it also plugs into the adapters.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re
import unicodedata
from collections import Counter
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from langchain_core.embeddings import Embeddings

__all__ = ["Embedder", "HashingEmbeddings"]

# words: runs of letters and digits in any script, with an English-style "'s" / "'t" kept on
# (on ASCII text exactly what ``[a-z0-9]+(?:'[a-z]+)?`` finds after lower-casing)
_TOKEN = re.compile(r"[^\W_]+(?:'[^\W\d_]+)?")
# scripts written without spaces between words (Han, kana): each character is a feature, and
# the bigrams of adjacent characters carry the words
_UNSPACED = re.compile("([\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002fa1f])")
_STOP = frozenset(
    {
        "a", "an", "and", "are", "as", "at", "be", "by", "for", "from", "has", "have", "how", "i",
        "in", "is", "it", "its", "of", "on", "or", "that", "the", "this", "to", "was", "were", "what",
        "when", "where", "which", "who", "why", "will", "with", "you", "your", "do", "does", "can",
        "my", "we", "our",
    }
)


class HashingEmbeddings(Embeddings):
    """Deterministic bag-of-words embeddings by feature hashing.

    Args:
        dim: vector size (e.g. 256 or 384). More dimensions, fewer collisions.
        bigrams: also hash adjacent word pairs (captures "refund window" vs "window refund").

    Example:
        >>> e = HashingEmbeddings(dim=64)
        >>> a, b = e.embed_documents(["refunds within 30 days", "the 30 day refund window"])
        >>> round(float(np.dot(a, b)), 2) > 0.3
        True
    """

    def __init__(self, dim: int = 256, *, bigrams: bool = True) -> None:
        if not isinstance(dim, int) or dim < 8:
            raise ValueError(f"dim={dim!r} must be an int >= 8")
        self.dim = dim
        self.bigrams = bigrams

    def _features(self, text: str) -> Counter[str]:
        words = []
        for w in _words(text.casefold()):
            if _UNSPACED.search(w):  # split only the unspaced script's characters
                words.extend(p for p in _UNSPACED.split(w) if p)
            elif w not in _STOP:
                words.append(w)
        feats: Counter[str] = Counter(words)
        if self.bigrams:
            feats.update(f"{a} {b}" for a, b in itertools.pairwise(words))
        return feats

    def vector(self, text: str) -> np.ndarray:
        """The embedding as a float32 numpy array (unit length, or zero for empty text)."""
        v = np.zeros(self.dim, np.float32)
        for feat, tf in self._features(text).items():
            h = hashlib.blake2b(feat.encode(), digest_size=8).digest()
            idx = int.from_bytes(h[:4], "little") % self.dim
            sign = 1.0 if h[4] & 1 else -1.0
            weight = 1.0 + math.log(tf)
            if " " in feat:
                weight *= 0.5  # a bigram confirms its words; it should not outweigh them
            v[idx] += sign * weight
        n = float(np.linalg.norm(v))
        if n == 0:
            # no content words: a fixed direction, so the vector stays valid for cosine
            v[0] = 1.0
            return v
        return v / n

    def embed_documents(self, texts: Sequence[str]) -> list[list[float]]:  # type: ignore[override]
        return [self.vector(t).tolist() for t in texts]

    def embed_query(self, text: str) -> list[float]:
        return self.vector(text).tolist()

    # Native async: a few microseconds of hashing a text, done on the event loop. LangChain's
    # default ``aembed_*`` runs the sync method on the loop's default executor, where it queued
    # behind whatever else holds those threads (sync ``invoke`` calls an app runs there, each
    # held for its whole timeout by a paused sidecar): an ``ainvoke`` took 2-9x its timeout.
    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        return self.embed_documents(texts)

    async def aembed_query(self, text: str) -> list[float]:
        return self.embed_query(text)


def _words(text: str) -> list[str]:
    """The words of case-folded ``text``: on ASCII text the regex's; elsewhere, composed
    (NFC: "Mu" + a combining diaeresis is "Mü") and read character by character, a word being
    a run of letters, digits and combining marks (the vowel signs of Devanagari or Thai, which
    the regex's ``\\w`` leaves out and would cut words at)."""
    if text.isascii():
        return _TOKEN.findall(text)
    text = unicodedata.normalize("NFC", text)
    words, cur = [], []
    for i, ch in enumerate(text):
        if ch.isalnum() or (cur and unicodedata.category(ch)[0] == "M"):
            cur.append(ch)
        elif ch == "'" and cur and "'" not in cur and text[i + 1 : i + 2].isalpha():
            cur.append(ch)  # (one "'s" / "'t" kept on, as the regex keeps it)
        elif cur:
            words.append("".join(cur))
            cur = []
    if cur:
        words.append("".join(cur))
    return words


class Embedder:
    """One interface over a LangChain ``Embeddings`` or a LlamaIndex ``BaseEmbedding``.

    Args:
        model: an object with ``embed_documents``/``embed_query`` (LangChain) or
            ``get_text_embedding_batch``/``get_query_embedding`` (LlamaIndex).

    Raises:
        TypeError: ``model`` is neither.
    """

    model: Any

    def __init__(self, model: Any) -> None:
        if isinstance(model, Embedder):
            model = model.model
        if hasattr(model, "embed_documents") and hasattr(model, "embed_query"):
            self.kind: Literal["langchain", "llama_index"] = "langchain"
        elif hasattr(model, "get_text_embedding_batch") and hasattr(model, "get_query_embedding"):
            self.kind = "llama_index"
        else:
            raise TypeError(
                f"embedding must be a LangChain Embeddings or a LlamaIndex BaseEmbedding, got "
                f"{type(model).__name__}"
            )
        self.model = model

    def documents(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.empty((0, 0), np.float32)
        if self.kind == "langchain":
            out = self.model.embed_documents(list(texts))
        else:
            out = self.model.get_text_embedding_batch(list(texts))
        return np.asarray(out, dtype=np.float32)

    def query(self, text: str) -> np.ndarray:
        if self.kind == "langchain":
            return np.asarray(self.model.embed_query(text), dtype=np.float32)
        return np.asarray(self.model.get_query_embedding(text), dtype=np.float32)

    async def adocuments(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.empty((0, 0), np.float32)
        if self.kind == "langchain":
            out = await self.model.aembed_documents(list(texts))
        else:
            out = await self.model.aget_text_embedding_batch(list(texts))
        return np.asarray(out, dtype=np.float32)

    async def aquery(self, text: str) -> np.ndarray:
        if self.kind == "langchain":
            return np.asarray(await self.model.aembed_query(text), dtype=np.float32)
        return np.asarray(await self.model.aget_query_embedding(text), dtype=np.float32)


# --------------------------------------------------------------------------------------------
