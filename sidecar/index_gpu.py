"""GPU index: vectors resident in device memory, recall through fused CUDA kernels, zero copy.

Storage: one ``(capacity, ld)`` array of float16 (default), float32 or int8 (plus a float32
scale per row), ``ld`` = dim rounded up to 16 bytes so every row starts aligned for 16-byte
loads; an int32 namespace id per row (-1: empty or deleted, never returned); float32 squared
norms (for L2). Capacity doubles when needed: the new array is filled by a device-to-device
copy and swapped in between two requests, so service does not stop.

Recall: the shared-memory segment is registered with the device (``cudaHostRegister``,
mapped), so the query in a request slot and the response area of that slot are addressable
by kernels. For each recall the dispatcher writes a small descriptor (query addresses, where
results go, k, namespace, optional filter mask) into another registered buffer and launches a
pre-captured CUDA graph (prep_queries + scan_topk; kernels/recall.cu), then synchronizes the
stream. A single query's graph is captured per slot, with that slot's query and result
addresses baked into prep's arguments: prep then reads the descriptor's head and the query
from host memory in one PCIe round trip instead of two dependent ones. Batches of more than
one query (``KALOS_GEMM_MIN_Q``) read the rows once for all their queries with tensor cores:
float16 rows through ``mma_filter`` (one captured graph: a threshold per query from a sample of
rows, then every row scored and filtered against it in registers, then the candidates' top-k),
float32 rows through one cuBLAS GEMM and a top-k kernel. The fused CUDA-core kernel for several
queries at once is slower than either.

int8 storage scans ``RESCORE_FACTOR * k`` candidates (``KALOS_RESCORE_FACTOR``) with the
quantized rows, then re-scores them exactly against a float16 copy kept in host memory, so the
device holds one byte per dimension: twice the rows per byte of float16. The sidecar's path
re-scores on the host; the
resident kernel re-scores on the device, reading only its candidates' rows of that copy
(registered, mapped) over PCIe.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import mmap
import os
import struct
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, NamedTuple

import numpy as np

from kalos_retrievers.arena import ARENA_HEADER_SIZE, ENTRY_SIZE
from kalos_retrievers.protocol import DOORBELL_SCOPE_ARGS_MAX, CarouselLayout, Metric, decode_recall_args

from . import carousel, knobs
from . import cuda_kernels as kernels
from .crowd import CrowdLane
from .direct import DirectSlots
from .index import (
    NS_ANY,
    BellScope,
    FatalDeviceError,
    Index,
    IndexCapacityError,
    SlotSpec,
    normalize_rows,
    topk_rows,
)
from .knobs import knob, whole
from .stats import HOST_TIMING

try:  # a queued batch's descriptor and CUDA calls in C (sidecar/_launch.c); optional
    from . import _launch
except ImportError:  # not built (no compiler at install): the same writes and calls in Python
    _launch = None  # type: ignore[assignment]

log = logging.getLogger("kalos.sidecar")

MAXQ: Final = 64  # KALOS_MAXQ
FUSED_MAX_Q: Final = 8
MERGE_UNROLL: Final = 4  # as in kernels/recall.cu
# Batches of at least GEMM_MIN_Q queries go through cuBLAS (tensor cores) + a top-k kernel;
# KALOS_GEMM=0 sends them through fused launches of up to FUSED_MAX_Q queries instead.
USE_GEMM: Final = os.environ.get("KALOS_GEMM", "1") != "0"
GEMM_MIN_Q: Final = max(2, knob("KALOS_GEMM_MIN_Q", whole(0), 2))
# Float16 batches of at least GEMM_MIN_Q queries go through mma_filter (tensor cores, the rows
# read once, candidates filtered against a threshold as they are scored) when it applies: a
# device of compute capability 8.0 or later, the threshold's sample fits, and the queries fit in
# shared memory. KALOS_MMA=0 sends them through cuBLAS instead (as float32 storage always does:
# its exact scores need float32 products).
USE_MMA: Final = os.environ.get("KALOS_MMA", "1") != "0"
# The GEMM path's threshold top-k (kernels tau_scores, filter_scores, select_cands): candidate
# lists of CAND_CAP per query, a sample of at most TAU_SAMPLE_MAX columns for the threshold.
# KALOS_THRESHOLD_TOPK=0 uses topk_scores (per-block buffers) for every batch.
USE_THRESHOLD_TOPK: Final = os.environ.get("KALOS_THRESHOLD_TOPK", "1") != "0"
CAND_CAP: Final = 8192
TAU_SAMPLE_MAX: Final = 16384
# ... and at least this many (or every row): 32 of the sample's runs of 32 rows (tau_sample)
TAU_SAMPLE_MIN: Final = 1024
# The most likely a query's candidate list may overflow (into the exact fallback, ~ms) for the
# sample size tau_sample picks (see there).
OVERFLOW_P: Final = 1e-6
# A float16 batch may be queued behind the batch the device is still searching (queues_behind):
# its own buffers (a second lane), its prep, sample and thresholds on a side stream while the
# earlier pass runs, its pass right after that pass, its selection beside the next one. With 32
# client processes at 1M rows the two cohorts' passes then follow each other with no host gap
# (S25-4: ~100 µs of ~540 per batch the device idled while the late requests were picked up
# and launched) and the ~50 µs of prep, thresholds and selection around each pass leave the
# path (mma_stages.py, S26-1: graph 430.7 µs against a pass of 377.7 for 16 queries).
# KALOS_QUEUE_BEHIND=0 turns it off. The pass of up to 16 queries then leaves SIDE_RESERVE of
# its resident block slots free (KALOS_SIDE_RESERVE) for those side kernels.
QUEUE_BEHIND: Final = os.environ.get("KALOS_QUEUE_BEHIND", "1") != "0"
# The launch of a batch queued behind another from its members' slot numbers in C (_launch.c,
# launch_behind_slots): its descriptor, then its eight CUDA calls through the driver. In Python
# that launch took ~73 µs of host time (S31-2), most of it per member, and the device waits
# for it whenever the cohort's last client comes back late. KALOS_QUEUE_C=0: the Python way.
QUEUE_C: Final = os.environ.get("KALOS_QUEUE_C", "1") != "0"
SIDE_RESERVE: Final = knob("KALOS_SIDE_RESERVE", whole(0), 32)
SELECT_GATHER: Final = 2048  # as in kernels/recall.cu
# as in kernels/recall.cu: tickets, bounds, counts per query; next row, direction, the batch-1
# lists' tag and how many blocks' heads and lists follow (LL_WORDS_PER_BLOCK words each: a
# 16-byte head among the heads, then LL_K_MAX entries of 16 bytes among the lists; see ll_merge)
SYNC_WORDS: Final = 3 * MAXQ + 4
SYNC_TAG: Final = 3 * MAXQ + 2
SYNC_LL_CAP: Final = 3 * MAXQ + 3
LL_WORDS_PER_BLOCK: Final = 132
_NEG_INF_ORD: Final = int(np.array([-np.inf], np.float32).view(np.int32)[0]) ^ 0x7FFFFFFF
# filters' device masks or lists kept on the sidecar's path (at most 1 MB each at 1M rows): a
# recall of one scope after another's finds its own still uploaded
MASKS_KEPT: Final = 8
GRAPH_CACHE: Final = 512  # captured graphs kept (per slot, k, batch bucket, grid)
# int8: candidates per result re-scored exactly (KALOS_RESCORE_FACTOR). 2, not 4: on the H200
# the resident kernel answered 1M rows 7.2 µs sooner in process (S12-3: 238.8-239.3 ->
# 231.6 µs, the merge of 20 candidates instead of 40), with recall@10 0.9992 both ways
# (gpu_recall.py); numpy's simulation of the quantization, 100k random rows at 33/97/384/768-d
# and 1M at 768-d, found no neighbour that 4 kept and 2 lost (1 lost 2-3%), and on 54,000 real
# MiniLM embeddings recall@10 0.9996 with 2, 0.9999 with 4 (docs/benchmarks.md, session 12).
RESCORE_FACTOR: Final = 2
RESCORE_FACTOR_MAX: Final = 16
# the resident kernel's blocks per SM at most; what fits decides below that
# (resident_blocks_per_sm): float16's kernel is built for 3 (80 registers; S13-2: -3.5 us at
# 100k rows, -6 at 1M, in process), int8's and float32's take 2 on an H200 (112-128 registers)
BELL_PER_SM: Final = 3
CAND_MAX: Final = 4096  # most int8 candidates per query (RESCORE_FACTOR x max k)
_CTYPE: Final = {"float32": "float", "float16": "__half", "int8": "signed char"}
_NPTYPE: Final = {"float32": np.float32, "float16": np.float16, "int8": np.int8}
_DESC_HEAD: Final = struct.Struct("<iiiiQii")  # n_queries k n_rows ns_id mask out_ld seq
# struct BellCtl in kernels/recall.cu: the host's line (stop n_rows ns_id n_slots seg slot0
# slot_size payload_off rows_off scores_off blob_off dim max_k arena arena_rows mode arena_version
# exact rescore n_spaces spaces), then from offset 128 what the kernel writes: served and 12 u64
# stamps
_BELL_CTL: Final = struct.Struct("<iiiiQQQiiiiiiQiiQQiiQ")
_BELL_SERVED: Final = 128
# struct BellSpaces in kernels/recall.cu: the scopes the resident kernel serves besides the
# default namespace (ids, args images' lengths, filter masks' or lists' device addresses, the
# images of 128 bytes each, the lists' lengths). A client may ring the kernel with a
# namespace's recall once the header's doorbell_spaces says so (v1.5), and with a filter's
# once its doorbell_args does (v1.6); the kernel answers it when its args are one of these
# images, and hands it back otherwise.
# KALOS_BELL_SPACES=0: the default namespace's recalls only, as before session 48;
# KALOS_BELL_FILTERS=0: namespaces without filters only, as in session 48.
BELL_SPACES: Final = os.environ.get("KALOS_BELL_SPACES", "1") == "1"
BELL_FILTERS: Final = BELL_SPACES and os.environ.get("KALOS_BELL_FILTERS", "1") == "1"
BELL_SPACES_MAX: Final = 8
BELL_ARGS_MAX: Final = DOORBELL_SCOPE_ARGS_MAX  # BELL_ARGS_WORDS x 4: the longest args the kernel compares
# touched rows a filter's mask follows one by one at least, or a 512th of the rows (_bell_mask):
# on the development VM, following them cost ~7 µs and ~0.1 µs a row on the host, making a
# mask whole ~26 µs at 100k rows and ~360 at 1M (a quarter of the rows kept), besides its upload
BELL_MASK_FOLLOW: Final = 256
_BELL_SPACES: Final = struct.Struct(f"<{2 * BELL_SPACES_MAX}i{BELL_SPACES_MAX}Q{BELL_SPACES_MAX * BELL_ARGS_MAX}s"
                                    f"{BELL_SPACES_MAX}i")  # fmt: skip
# NS_LIST in kernels/recall.cu: the ns id that says a recall's rows are a list (the mask field
# its int32 device address, n_rows its length), not the rows below n_rows through a mask
NS_LIST: Final = -4
# A filter that keeps at most 1/FILTER_LIST of the rows below the high-water mark is scanned
# through a list of its rows (scan_list, the resident kernel's NS_LIST entries): a mask makes
# the scan walk every row of the index (its namespace id and mask byte, and a round per grid's
# worth of rows), the list only the filter's, at 4 bytes a row where the mask is 1 (and kept
# up to date row by row where a list is uploaded whole: hence only selective filters).
# KALOS_FILTER_LIST=0: masks always, as before session 52.
FILTER_LIST_DEFAULT: Final = 16


def filter_list_fraction(value: str | None) -> int:
    """KALOS_FILTER_LIST's value (None or empty: :data:`FILTER_LIST_DEFAULT`): a filter that
    keeps at most 1/value of the rows is scanned through a list of them; 0: never. Anything
    but a non-negative integer is refused with a ValueError naming it.

    >>> filter_list_fraction(None), filter_list_fraction(" 4 "), filter_list_fraction("0")
    (16, 4, 0)
    """
    return _whole_number("KALOS_FILTER_LIST", value, FILTER_LIST_DEFAULT,
                         "a filter keeping at most 1/N of the rows is scanned through a list of them; 0: never")


def _whole_number(name: str, value: str | None, default: int, meaning: str) -> int:
    """An environment variable's whole number >= 0 (None or blank: ``default``); anything
    else a ValueError that names the variable and says what it means."""
    v = (value or "").strip()
    if not v:
        return default
    if not (v.isascii() and v.isdigit()):
        raise ValueError(f"{name}={value!r}: expected a whole number >= 0 ({meaning}; default {default})")
    return int(v)


FILTER_LIST = knob("KALOS_FILTER_LIST", filter_list_fraction, FILTER_LIST_DEFAULT)
# Lists only where the index holds at least LIST_MIN_ROWS rows below its high-water mark: the
# walk a list saves grows with the rows, and while the resident kernel serves any list it runs
# its build with lists, which costs the default namespace's recall. On an H100 (S54-5/6, a
# 1,000-row scope): at 201,000 rows its recall through a list cost what the walk did (small
# namespace 32.4-33.7 µs against 31.4, a 1% filter 40.6-44.6 against 42.1) and the default
# recall 2.2 µs more; at 402,000 rows the list saved 4 and 13 µs and the default's cost read
# 0.4. S55-1's sweep: no gain at 151k rows, 10-15 µs for a 1% filter from 302k, 8 at 201k (S54
# read none there). 2^18 lies between. KALOS_LIST_MIN_ROWS=0: lists at any size, as in sessions 52-53.
LIST_MIN_ROWS_DEFAULT: Final = 1 << 18


def list_min_rows(value: str | None) -> int:
    """KALOS_LIST_MIN_ROWS' value (None or empty: :data:`LIST_MIN_ROWS_DEFAULT`): the fewest
    rows (below the high-water mark) an index must hold for a filter or a namespace to be
    scanned through a list of its rows; 0: any. Anything but a non-negative integer is refused
    with a ValueError naming it.

    >>> list_min_rows(None), list_min_rows(" 0 "), list_min_rows("500000")
    (262144, 0, 500000)
    """
    return _whole_number("KALOS_LIST_MIN_ROWS", value, LIST_MIN_ROWS_DEFAULT, "the fewest rows an index holds "
                         "for filters and namespaces to be scanned through lists of their rows; 0: any")


LIST_MIN_ROWS = knob("KALOS_LIST_MIN_ROWS", list_min_rows, LIST_MIN_ROWS_DEFAULT)


def use_list(kept: int, high: int, fraction: int | None = None, floor: int | None = None) -> bool:
    """Whether a filter that keeps ``kept`` of the rows below ``high`` is scanned through a
    list of its rows rather than a mask: where it keeps at most 1/``fraction`` of them
    (default :data:`FILTER_LIST`; 0: never) and ``high`` is at least ``floor`` (default
    :data:`LIST_MIN_ROWS`).

    >>> use_list(1_000, 1_000_000, 16, 0), use_list(62_500, 1_000_000, 16, 0), use_list(62_501, 1_000_000, 16, 0)
    (True, True, False)
    >>> use_list(0, 100, 16, 0), use_list(5, 100, fraction=0, floor=0), use_list(1_000, 200_000, 16, 262_144)
    (True, False, False)
    """
    f = FILTER_LIST if fraction is None else fraction
    return f > 0 and high >= (LIST_MIN_ROWS if floor is None else floor) and kept * f <= high


# A batch of 2 or more queries through a list takes fused launches of FUSED_MAX_Q queries
# (scan_list), where through a mask it takes one GEMM / mma pass over every row below ``high``
# for up to MAXQ queries: the list's batch costs ~(launches) x (a fixed part + its rows), the
# mask's ~(passes) x high. LIST_LAUNCH_ROWS is a launch's fixed part in rows of the mask's pass.
# On an H100 at 1,005,000 rows (S58, 5,000-row scopes) a list's launch of 8 queries cost ~116
# µs: list / mask 0.45, 0.71, 0.91 at 16, 32, 48 queries, 1.14 at 64 (S56, before the spread
# sample), the crossover near 52-55 queries. At 300,011 rows (S60, list_grid.py, 2,500- and
# 10,000-row lists) the list won at 8 and 16 queries (109 / 215 µs against the mask's 229 /
# 233) and lost at 48 (629 against 284): a launch of 8 cost ~105-110 µs whatever the list's
# length (2,500 or 10,000 rows), ~13.5 µs a query, where the pass cost ~0.77 ns a row there and
# ~0.9 at 1M. The default fits both sizes: 140,000 keeps 16 on the list at 300,011 rows (2 x
# 142,500 <= 300,011) and 48 at 1,005,000 (6 x 145,000), and sends 56 there to the mask
# (S59's 150,000 sent S60's 16 at 300,011 rows to the mask, ~9% slower). Batch 1, int8,
# KALOS_GEMM=0 and batches below GEMM_MIN_Q (whose mask batches are fused launches too), and
# lists longer than CAND_CAP, always take the list where use_list says so
# (GpuIndex._mask_is_cheaper). KALOS_LIST_LAUNCH_ROWS=0: every batch does, as before session 59.
LIST_LAUNCH_ROWS_DEFAULT: Final = 140_000


def list_launch_rows(value: str | None) -> int:
    """KALOS_LIST_LAUNCH_ROWS' value (None or empty: :data:`LIST_LAUNCH_ROWS_DEFAULT`): what a
    fused launch through a list costs beyond its own rows, in rows of a mask's GEMM / mma pass
    (:func:`list_pays`); 0: a listed batch never turns to the mask. Anything but a
    non-negative integer is refused with a ValueError naming it.

    >>> list_launch_rows(None), list_launch_rows(" 0 "), list_launch_rows("200000")
    (140000, 0, 200000)
    """
    return _whole_number("KALOS_LIST_LAUNCH_ROWS", value, LIST_LAUNCH_ROWS_DEFAULT, "what a fused launch through "
                         "a list costs beyond its rows, in rows of a mask's GEMM pass; 0: batches always take lists")


LIST_LAUNCH_ROWS = knob("KALOS_LIST_LAUNCH_ROWS", list_launch_rows, LIST_LAUNCH_ROWS_DEFAULT)


def list_pays(n: int, kept: int, high: int, launch_rows: int | None = None) -> bool:
    """Whether a batch of ``n`` queries over a list of ``kept`` rows (one :func:`use_list`
    chose) costs less than the mask's GEMM / mma passes over the ``high`` rows below the
    high-water mark: ``ceil(n / FUSED_MAX_Q) * (launch_rows + kept) <= ceil(n / MAXQ) * high``
    (``launch_rows`` default :data:`LIST_LAUNCH_ROWS`; 0, or a single query: always).

    >>> list_pays(48, 5_000, 1_005_000), list_pays(56, 5_000, 1_005_000), list_pays(64, 5_000, 1_005_000)
    (True, False, False)
    >>> list_pays(1, 5_000, 1_000), list_pays(64, 5_000, 1_000, launch_rows=0), list_pays(17, 5_000, 300_000)
    (True, True, False)
    """
    r = LIST_LAUNCH_ROWS if launch_rows is None else launch_rows
    if n <= 1 or r == 0:
        return True
    return -(-n // FUSED_MAX_Q) * (r + kept) <= -(-n // MAXQ) * high


_BELL_STAMPS: Final = struct.Struct("<12Q")  # at _BELL_SERVED + 8
# BellCtl::mode, the BELL_* bits: loads from host memory with ld.global.cv (1), stores with
# st.global.wt (2), a system fence after the RESPONSE word (4), ld/st.relaxed.sys otherwise (8).
# KALOS_DOORBELL_MODE picks them (benchmarks/doorbell_probe.py --modes compares them).
# BELL_ARENA_DEVICE (16): the arena address the kernel gets is a device copy of the row table.
# The float kernels' answer read each hit's entry from host memory, one PCIe round trip (~2 µs)
# on every recall's path; the table cannot change while the kernel runs (the sidecar stops it
# before any write), so resume_doorbell copies it to the device when it changed since the last
# copy (1.6 MB at 100k rows, ~0.1 ms; 16 MB at 1M). int8's kernel reads the entries with the
# candidates' rows, off that path, and keeps reading host memory. KALOS_ARENA_COPY=0: host reads.
BELL_ARENA_DEVICE: Final = 16
ARENA_COPY: Final = os.environ.get("KALOS_ARENA_COPY", "1") != "0"
DOORBELL_MODE: Final = knob("KALOS_DOORBELL_MODE", whole(0), 7) & ~BELL_ARENA_DEVICE  # (ours to set)
_BELL_WORDS: Final = 12  # BELL_WORDS in kernels/recall.cu
_BELL_CAND_WORDS: Final = 20  # BELL_CAND_WORDS: int8 candidate area, words per candidate
DOORBELL_MAX_K: Final = 1024
# On by default since session 5 (docs/gpu-notes.md): a 100k recall through the resident kernel
# takes ~70 us in process (the graph path ~80 us plus the sidecar's Python), starting it ~0.1
# ms of host time and stopping it ~30-80 us. (Session 4's kernel saw requests ~80 us late and
# took ~14 ms to stop: every thread read its settings and the request words over PCIe.)
# KALOS_DOORBELL=0 turns it off.
USE_DOORBELL: Final = os.environ.get("KALOS_DOORBELL", "1") == "1"
# Diagnostics for batched recalls through mma_filter (benchmarks/ab_sidecars.py --env-a): "1" times
# each batch (CUDA events around its graph, and the host's clock from the launch to the end of
# the wait) and reports the medians in describe()["batch_timing"]; for batches queued behind
# another, their pass, front and place against the pass ahead in describe()["queued_timing"]
# (see queued_timing). (S14-3, 32 processes at 1M rows: the device took 431 us per batch of
# ~16 and the host was ready when it ended; waiting by polling the end event instead of
# synchronizing was tried there and lost 1,670 recalls/s. S29-3: the queued passes ~390 us,
# the device idle ~90 us before each on average.) "host" (stats.HOST_TIMING): the host's clock
# only (the dispatcher's phases, behind_stamps), without the events: each queued launch made as
# in service (S31-2: "1"'s events cost the launch ~17 µs of host time, "ql_cuda" 40 against 23).
BATCH_TIMING: Final = os.environ.get("KALOS_BATCH_TIMING", "0") == "1"
_DOORBELL_STOP_S: Final = 5.0  # a resident kernel that has not stopped by then is a fault
# The carousel for crowds of batch-1 recalls (sidecar/carousel.py, sidecar/crowd.py; float16
# rows, compute capability 8.0+ for its mma.sync), started only while a crowd recalls
# (dispatcher.CAROUSEL_MIN clients at once). KALOS_CAROUSEL picks how a crowd's recalls reach it:
# "direct" (the default since session 40): the clients write them into its slots themselves
# (protocol v1.4, no sidecar Python on their way); on the H200, 32 processes at 1M rows got
# 42.2k recalls/s against the queued batches' 35.3k in one lease, p99 1.00 against 1.35 ms
# (docs/gpu-notes.md, S40-3). "1": the sidecar's lane boards them (no faster than the queued
# batches through the sidecar, S36-3). "0": no carousel; a crowd is served by queued batches.


def carousel_mode(value: str | None) -> tuple[bool, bool]:
    """KALOS_CAROUSEL's value (None or empty: the default, "direct") as (carousel on, direct);
    any other value than "0", "1" or "direct" is refused with a ValueError naming it."""
    v = (value or "direct").strip() or "direct"
    if v not in ("0", "1", "direct"):
        raise ValueError(f"KALOS_CAROUSEL={value!r}: expected 0 (off), 1 (the sidecar's lane) or direct (the default)")
    return v != "0", v == "direct"


USE_CAROUSEL, CAROUSEL_DIRECT = knob("KALOS_CAROUSEL", carousel_mode, carousel_mode(None))
# how long a stop waits for the direct requests aboard, and those asked before the clients saw
# the epoch change, before it abandons them (their clients then ask again the usual way)
_CAROUSEL_DRAIN_S: Final = 0.05
_DESC_Q: Final = 32  # byte offsets of the three u64 arrays in struct Desc
_DESC_ROWS: Final = _DESC_Q + 8 * MAXQ
_DESC_SCORES: Final = _DESC_ROWS + 8 * MAXQ
_DESC_SIZE: Final = _DESC_SCORES + 8 * MAXQ
_LANE_DESC: Final = (0, 2048)  # each lane's descriptor in the registered page
_LANE_OVERFLOW: Final = (4000, 4004)  # each lane's overflow flag (select_cands), same page
_PARAMS_SIZE: Final = 2048
# cudaError codes after which the context is unusable
_STICKY: Final = frozenset({214, 700, 701, 702, 714, 715, 716, 717, 718, 719, 720, 999})
_CUDA_R_32F, _CUDA_R_16F = 0, 2
_MMA_NT: Final = (2, 4, 8)  # mma_filter instantiations: n-tiles of 8 queries (16, 32, 64)


def rescore_factor(env: Mapping[str, str]) -> int:
    """int8 storage's candidates per result (``KALOS_RESCORE_FACTOR``, default
    ``RESCORE_FACTOR``): the quantized scan keeps ``factor * k`` rows, which are re-scored
    exactly from the float16 copy. Fewer candidates make the scan's merge and the re-scoring
    cheaper and may lose a true neighbour whose quantized score fell below them.

    Raises:
        ValueError: not an integer in [1, ``RESCORE_FACTOR_MAX``].
    """
    raw = env.get("KALOS_RESCORE_FACTOR", "").strip()
    if not raw:
        return RESCORE_FACTOR
    try:
        f = int(raw)
    except ValueError:
        f = 0
    if not 1 <= f <= RESCORE_FACTOR_MAX:
        raise ValueError(f"KALOS_RESCORE_FACTOR={raw!r}: expected an integer from 1 to {RESCORE_FACTOR_MAX}")
    return f


def tpr_override(env: Mapping[str, str]) -> int:
    """Threads per row for the scans from ``KALOS_TPR`` (a diagnostic for benchmarks: the
    backend picks by the row's size otherwise); 0 when unset or blank.

    Raises:
        ValueError: not one of 1, 2, 4, 8, 16, 32.
    """
    raw = env.get("KALOS_TPR", "").strip()
    if not raw:
        return 0
    if raw not in ("1", "2", "4", "8", "16", "32"):
        raise ValueError(f"KALOS_TPR={raw!r}: expected 1, 2, 4, 8, 16 or 32")
    return int(raw)


def bell_blocks_per_sm(env: Mapping[str, str]) -> int:
    """The most blocks per SM the resident kernel runs with, from ``KALOS_BELL_PER_SM`` (a
    diagnostic, default ``BELL_PER_SM``); its registers and shared memory may allow fewer. More
    need a build whose kernel fits them (``-DKALOS_BELL_MINB_I8=3`` in ``KALOS_KERNEL_OPTIONS``
    for int8): blocks that cannot all be resident would hang it, so the host always checks the
    compiled kernel's registers first.

    Raises:
        ValueError: not an integer from 1 to 8.
    """
    raw = env.get("KALOS_BELL_PER_SM", "").strip()
    if not raw:
        return BELL_PER_SM
    if raw not in ("1", "2", "3", "4", "5", "6", "7", "8"):
        raise ValueError(f"KALOS_BELL_PER_SM={raw!r}: expected an integer from 1 to 8")
    return int(raw)


def gpu_memory_limit(env: Mapping[str, str]) -> int:
    """The bytes of GPU memory the index may take, from ``KALOS_GPU_MEMORY_LIMIT`` (a test's
    knob: a small limit makes capacity errors cheap to reach); 0, unset or blank: no limit.

    Raises:
        ValueError: not a whole number.
    """
    raw = env.get("KALOS_GPU_MEMORY_LIMIT", "").strip()
    if not raw:
        return 0
    if not (raw.isascii() and raw.isdigit()):  # (isdigit alone takes "²", which int() refuses)
        raise ValueError(f"KALOS_GPU_MEMORY_LIMIT={raw!r}: expected a whole number of bytes (0: no limit)")
    return int(raw)


def environment_errors(env: Mapping[str, str]) -> list[str]:
    """What is wrong with the variables a :class:`GpuIndex` reads when it is made (the rest
    are read at import: :data:`knobs.ERRORS <sidecar.knobs.ERRORS>`), one line each: checked
    by ``serve`` wherever a GPU backend could be picked, before it looks for a GPU, so a
    mistyped value fails on the laptop that could have used a GPU, not first on the GPU host."""
    errors = []
    for read in (rescore_factor, tpr_override, bell_blocks_per_sm, gpu_memory_limit):
        try:
            read(env)
        except ValueError as e:
            errors.append(str(e))
    return errors


class SmLimits(NamedTuple):
    """An SM's resources that bound how many blocks it holds at once (device properties)."""

    regs: int  # 32-bit registers (regsPerMultiprocessor)
    smem: int  # shared memory, bytes (sharedMemPerMultiprocessor)
    threads: int  # maxThreadsPerMultiProcessor
    smem_reserved: int  # shared memory the system keeps per block (reservedSharedMemPerBlock)


def resident_blocks_per_sm(cap: int, regs: int, threads: int, smem_dynamic: int, smem_static: int,
                           sm: SmLimits) -> int:  # fmt: skip
    """How many blocks of a kernel fit on one SM at once, at most ``cap``: the resident kernel's
    blocks must all be resident together (one that waits for room behind blocks that never
    end hangs it), so this errs low. CUDA's rules (sm_50 to sm_90): registers are allocated
    per warp in units of 256 (a kernel of 81 registers per thread takes as many as one of 88),
    shared memory per block in units of 128 bytes plus what the system reserves per block,
    and an SM holds at most ``sm.threads`` threads.

    The H200 (65,536 registers, 228 KiB, 2,048 threads): float16's resident kernel (80
    registers, ~23 KB of shared memory) gets 3 at ``cap`` 3, int8's (128) and float32's (112) 2;
    a T4 (64 KiB, 1,024 threads) gives float16's 2.
    """
    warp_regs = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = sm.regs // (warp_regs * -(-threads // 32))
    block_smem = max(128, -(-(smem_dynamic + smem_static + sm.smem_reserved) // 128) * 128)
    by_smem = sm.smem // block_smem
    by_threads = sm.threads // threads
    return max(0, min(cap, by_regs, by_smem, by_threads))


def choose_tpr(chunks: int) -> int:
    """Threads per row: few enough that each thread issues at least 16 loads per row (768-d
    float16: 4 threads of 24 loads). Fewer threads per row means more rows per round, so fewer
    latency-bound rounds per block: on the H200, 4 beat 8 by 0-10 us at 100k and 1M rows, and
    16 or 32 were 5-130 us slower (benchmarks/scan_variants.py, session 4)."""
    tpr = 1
    while tpr < 32 and chunks // (tpr * 2) >= 16:
        tpr *= 2
    return tpr


def bell_spaces_table(spaces: Sequence[tuple[bytes, int, int, int]]) -> tuple[bytes, tuple[bytes, ...]]:
    """The resident kernel's scope table (``struct BellSpaces``) for ``spaces``, (args,
    namespace id, filter's device address or 0, list length) quadruples in order of
    preference, and the args it holds. The address is a mask's (uint8 per row) where the list
    length is -1, else a list's of that many int32 rows: the entry's id is then NS_LIST.

    Each entry's args are those a client writes for a recall in that scope
    (:func:`~kalos_retrievers.protocol.encode_recall_args` of a namespace and an optional
    filter), zero-padded to :data:`BELL_ARGS_MAX` bytes: the kernel compares a request's args
    with them byte for byte. Left out: empty args (the default namespace's recalls carry none),
    args longer than :data:`BELL_ARGS_MAX` bytes, a negative id, args already taken, and everything past
    :data:`BELL_SPACES_MAX` entries.

    >>> from kalos_retrievers.protocol import encode_recall_args as a
    >>> table, keys = bell_spaces_table([(a("notes", None), 3, 0, -1), (b"", 0, 0, -1), (a("x" * 123, None), 4, 0, -1)])
    >>> keys == (a("notes", None),), len(table)
    (True, 1184)
    """
    ids, lens, rows, masks = ([0] * BELL_SPACES_MAX for _ in range(4))
    image, keys = bytearray(), []
    for args, ns_id, mask, n_list in spaces:
        if len(keys) == BELL_SPACES_MAX:
            break
        if not args or ns_id < 0 or len(args) > BELL_ARGS_MAX or args in keys:
            continue
        i = len(keys)
        ids[i], lens[i], masks[i] = (NS_LIST if n_list >= 0 else ns_id), len(args), mask
        rows[i] = max(n_list, 0)
        image += args.ljust(BELL_ARGS_MAX, b"\0")
        keys.append(args)
    return _BELL_SPACES.pack(*ids, *lens, *masks, bytes(image), *rows), tuple(keys)


def scope_names(keys: Sequence[bytes]) -> tuple[list[str], list[dict[str, Any]]]:
    """The namespaces (no filter) and the filters (``{"namespace", "filter"}``) among the
    scopes whose args are ``keys`` (:func:`bell_spaces_table`'s): how the index's
    :meth:`describe` names what its resident kernel serves."""
    names: list[str] = []
    filters: list[dict[str, Any]] = []
    for key in keys:
        namespace, flt = decode_recall_args(key)
        if flt is None:
            names.append(namespace)
        else:
            filters.append({"namespace": namespace, "filter": flt})
    return names, filters


def _pow2(x: int) -> int:
    p = 1
    while p < x:
        p <<= 1
    return p


@functools.cache
def _sample_lambda(k: int) -> float:
    """The least λ (at least 3k) with P(Poisson(λ) < k) <= OVERFLOW_P, to a hundredth above."""
    lo, hi = 3.0 * k, 3.0 * k
    while _poisson_below(hi, k) > OVERFLOW_P:
        lo, hi = hi, 2 * hi
    while hi - lo > 0.01:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _poisson_below(mid, k) > OVERFLOW_P else (lo, mid)
    return hi


def _poisson_below(lam: float, k: int) -> float:
    """P(Poisson(lam) < k)."""
    return sum(math.exp(j * math.log(lam) - lam - math.lgamma(j + 1)) for j in range(k))


@functools.lru_cache(maxsize=256)  # asked two or three times per batch, with few distinct (k, high)
def tau_sample(k: int, high: int) -> int | None:
    """How many rows (a power of two) give a query's threshold for the threshold top-k: its
    k-th best eligible score among them (tau_scores); every eligible row scoring at least that
    is a candidate, and a list of more than CAND_CAP candidates overflows into the exact
    fallback. None: more rows than tau_scores' shared memory holds (large k on many rows).

    The S rows are S / 32 runs of 32 rows, one in each of S / 32 equal strata of the
    ``high`` rows at a hashed place (kernels/recall.cu, ``spread_start``), and S is at least
    TAU_SAMPLE_MIN (32 runs) or every row. A scope of a share f of the rows that is spread
    over them, or lies in blocks of many strata, has about f * S of them, its threshold the
    k-th best of those and about k * high / S candidates, as unscoped; a block of fewer rows
    than a stratum (32 * high / S) may hold none of them, and then, if it has more than
    CAND_CAP rows, its batches take the exact path. Until session 56 the sample was the first
    S rows: a namespace written after another had none of them, its threshold -inf, and every
    one of its rows a candidate (S56-2: 64 queries in half of 1M rows 7.6 ms, unscoped 0.92).

    With the rows in no order related to the query (other orders only cost the fallback's
    time), the share of rows reaching the k-th best of S sampled rows is above p exactly when
    fewer than k of the S lie in the top p of all rows: a list overflows with probability
    P(Binomial(S, CAND_CAP / high) < k), which P(Poisson(S * CAND_CAP / high) < k) bounds
    here. S is the least power of two with S * CAND_CAP / high >= 3k (about CAND_CAP / 3
    candidates expected per query; None if that does not fit), raised where it fits until
    that ratio reaches λ_k, whose Poisson tail is OVERFLOW_P (λ_1 = 13.8; from k = 13 on 3k
    is enough). At 3k alone (before session 28) k = 1 overflowed for up to one query in 20
    (e^-3; 1 in 67 at 1M rows, 1 in 211 at 200k: the power of two rounds up), so that a
    batch of 16 such queries took the exact path up to 56% of the time. The raised sample
    fits TAU_SAMPLE_MAX up to ~9.7M rows at k = 1."""
    base = _pow2(max(2, -(-3 * k * high // CAND_CAP)))
    if base > TAU_SAMPLE_MAX:
        return None
    safe = _pow2(math.ceil(_sample_lambda(k) * high / CAND_CAP))
    return min(max(base, min(safe, TAU_SAMPLE_MAX), TAU_SAMPLE_MIN), _pow2(high))


def queued_timing(times: Sequence[tuple[int, float, float, float, float]]) -> dict[str, float]:
    """Summarize KALOS_BATCH_TIMING's records of batches queued behind another, each
    (queries, pass us, front us, lead us, gap us), for ``describe()["queued_timing"]``.

    ``lead`` is how long before the end of the pass ahead the batch's front started on the
    device (its launch, near enough), ``gap`` how long the device's stream idled between that
    pass and this one (NaN both when the pass ahead was not timed). With every batch queued in
    time, the passes follow each other and ``period`` (pass + gap) is the pass alone;
    ``late_share`` is the fraction of passes that waited more than 5 µs for their front
    (their prep, sample and thresholds) or their launch."""
    t = np.asarray(times, dtype=np.float64).reshape(-1, 5)
    out: dict[str, float] = {"batches": len(t)}
    if not len(t):
        return out
    out["queries_mean"] = round(float(t[:, 0].mean()), 2)
    for j, name in ((1, "pass"), (2, "front")):
        out[f"{name}_p50_us"] = round(float(np.median(t[:, j])), 1)
        out[f"{name}_mean_us"] = round(float(t[:, j].mean()), 1)
    known = t[~np.isnan(t[:, 4])]
    out["followed"] = len(known)  # batches whose pass ahead was timed
    if len(known):
        for j, name in ((3, "lead"), (4, "gap")):
            out[f"{name}_p50_us"] = round(float(np.median(known[:, j])), 1)
            out[f"{name}_mean_us"] = round(float(known[:, j].mean()), 1)
        out["gap_p90_us"] = round(float(np.percentile(known[:, 4], 90)), 1)
        out["period_mean_us"] = round(float((known[:, 1] + known[:, 4]).mean()), 1)
        out["late_share"] = round(float((known[:, 4] > 5.0).mean()), 3)
    return out


def _c_launch() -> bool:
    """Whether queued launches go through _launch: built, and KALOS_QUEUE_C not 0."""
    return QUEUE_C and _launch is not None


@functools.cache
def _driver_calls() -> tuple[int, int, int] | None:
    """The addresses of the CUDA driver's cuGraphLaunch, cuEventRecord and cuStreamWaitEvent
    for _launch.run (libcuda, which CuPy's runtime loaded already), or None where they cannot be
    found. The runtime's handles that CuPy holds (cudaGraphExec_t, cudaStream_t, cudaEvent_t) are
    the driver's (CUgraphExec, CUstream, CUevent), and the runtime makes its primary context the
    serve loop's current one, which the driver's calls use."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fns = tuple(ctypes.cast(getattr(lib, f), ctypes.c_void_p).value
                    for f in ("cuGraphLaunch", "cuEventRecord", "cuStreamWaitEvent"))  # fmt: skip
    except (OSError, AttributeError):
        log.warning("the CUDA driver's launch functions were not found: queued launches through CuPy")
        return None
    return fns if all(fns) else None  # type: ignore[return-value]


class _Lane:
    """The buffers of one batched float16 search, so that a second batch can be queued behind
    a first still on the device (:meth:`GpuIndex.queues_behind`). Lane 0 holds the index's own
    buffers (every other path uses them), lane 1 a second set made at its first use. Each has
    its descriptor and overflow flag in the registered descriptor page, and a side stream
    (high priority) for the kernels around its pass: prep, sample and thresholds before it,
    the selection after it."""

    def __init__(self, idx: GpuIndex, i: int) -> None:
        cp = idx.cp
        self.i = i
        self.desc_off = _LANE_DESC[i]
        self.desc_addr = idx.desc_addr + self.desc_off
        self.overflow = np.frombuffer(idx._desc_mm, np.int32, 1, _LANE_OVERFLOW[i])
        self.overflow_addr = idx.desc_addr + _LANE_OVERFLOW[i]
        with idx.device:
            if idx._sample_buf is None:
                idx._sample_buf = cp.empty(MAXQ * TAU_SAMPLE_MAX, cp.float32)
            if i == 0:
                self.params, self.qbuf, self.qbuf_h, self.qbuf_i8 = idx.params, idx.qbuf, idx.qbuf_h, idx.qbuf_i8
                self.tau, self.cand_k, self.cand_v = idx.tau, idx.cand_k, idx.cand_v
                self.cand_count, self.sample_buf = idx.cand_count, idx._sample_buf
            else:
                self.params = cp.zeros(_PARAMS_SIZE, cp.uint8)
                self.qbuf = cp.zeros((MAXQ, idx.ld), cp.float32)
                self.qbuf_h = cp.zeros((MAXQ, idx.ld), cp.float16)
                self.qbuf_i8 = cp.zeros((MAXQ, idx.ld), cp.int8)
                self.tau = cp.zeros(MAXQ, cp.float32)
                self.cand_k = cp.empty(MAXQ * CAND_CAP, cp.float32)
                self.cand_v = cp.empty(MAXQ * CAND_CAP, cp.int32)
                self.cand_count = cp.zeros(MAXQ, cp.int32)
                self.sample_buf = cp.empty(MAXQ * TAU_SAMPLE_MAX, cp.float32)
                # the zero fills ran on the legacy stream, which the index's non-blocking
                # streams do not wait for (cand_count must read 0 at the first pass)
                idx.device.synchronize()
            # CUDA clamps a priority to the device's range: -5 is the highest on the H200
            self.side = cp.cuda.Stream(non_blocking=True, priority=-5)
            ev = lambda: cp.cuda.Event(block=False, disable_timing=True)  # noqa: E731
            self.front_done, self.pass_done, self.done = ev(), ev(), ev()


class _Pending(NamedTuple):
    """A launch left running: its wait, the lane whose buffers it holds (0 for every path but
    a queued batch's), and an event recorded after it (None: not known, see pending_done)."""

    wait: Callable[[], None]
    lane: int
    end: Any


class GpuIndex(Index):
    zero_copy = True

    def __init__(self, dim: int, metric: int, ordinal: int, dtype: str = "float16",
                 memory_limit: int | None = None) -> None:  # fmt: skip
        super().__init__(dim, metric)
        # the environment's settings first: a bad one fails before a CUDA context exists (those
        # read at import were recorded, not raised: a script that makes an index itself, a
        # benchmark say, must not run with a default it was not given; serve checks them too)
        errors = knobs.ERRORS + environment_errors(os.environ)
        if errors:
            raise ValueError("; ".join(errors))
        tpr = tpr_override(os.environ)
        self.bell_per_sm = bell_blocks_per_sm(os.environ)
        self.rescore_factor = rescore_factor(os.environ) if dtype == "int8" else RESCORE_FACTOR
        import cupy as cp

        self.cp = cp
        self.dtype = dtype
        self.ordinal = ordinal
        self.device = cp.cuda.Device(ordinal)
        self.device.use()
        props = cp.cuda.runtime.getDeviceProperties(ordinal)
        self.device_name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        self.sms = int(props["multiProcessorCount"])
        self.smem_optin = int(props.get("sharedMemPerBlockOptin", 48 * 1024))
        self.name = f"cuda:{ordinal}"
        self.ctype = _CTYPE[dtype]
        self.np_dtype = _NPTYPE[dtype]
        isz = np.dtype(self.np_dtype).itemsize
        self.ld = -(-dim // (16 // isz)) * (16 // isz)
        self.tpr = tpr or choose_tpr(self.ld * isz // 16)
        self.memory_limit = memory_limit or gpu_memory_limit(os.environ) or None
        self.fault_inject = os.environ.get("KALOS_FAULT_INJECT", "")
        self._compile()
        self.stream = cp.cuda.Stream(non_blocking=True)
        with self.device:
            self.data = cp.zeros((0, self.ld), self.np_dtype)
            self.ns = cp.full(0, -1, cp.int32)
            self.sqnorm = cp.zeros(0, cp.float32)
            self.rowscale = cp.zeros(0, cp.float32) if dtype == "int8" else None
            # int8: the rows in float16 for exact re-scoring, in host memory (see _new_exact)
            self.exact: np.ndarray | None = None
            self._exact_reg = 0  # its registered address (0: not registered)
            self.params = cp.zeros(_PARAMS_SIZE, cp.uint8)
            self.qbuf = cp.zeros((MAXQ, self.ld), cp.float32)
            self.qbuf_h = cp.zeros((MAXQ, self.ld), cp.float16)
            self.qbuf_i8 = cp.zeros((MAXQ, self.ld), cp.int8)
            # 4 blocks of 256 per SM keep enough loads in flight (H200: 0.91 of copy bandwidth at
            # 1M rows, against 0.78 with 2 blocks per SM)
            self.max_grid = 4 * self.sms
            # tickets, the global bounds (ordered ints, -inf) and append counts of scan_topk, then
            # the batch-1 lists (zero: no tag yet) for up to max_grid blocks, their first tag 1
            sync = np.zeros(SYNC_WORDS + LL_WORDS_PER_BLOCK * self.max_grid, np.int32)
            sync[MAXQ : 2 * MAXQ] = _NEG_INF_ORD
            sync[SYNC_TAG] = 1
            sync[SYNC_LL_CAP] = self.max_grid
            self.sync = cp.asarray(sync)
            self.tau = cp.zeros(MAXQ, cp.float32)
            self.cand_k = cp.empty(MAXQ * CAND_CAP, cp.float32)
            self.cand_v = cp.empty(MAXQ * CAND_CAP, cp.int32)
            self.cand_count = cp.zeros(MAXQ, cp.int32)
            self.scratch_k = cp.empty(self.max_grid * FUSED_MAX_Q * 1024, cp.float32)
            self.scratch_v = cp.empty(self.max_grid * FUSED_MAX_Q * 1024, cp.int32)
        self.threshold_overflows = 0
        self.mma_batches = 0  # batches answered by mma_filter (diagnostics and tests)
        # mma_filter's shared-memory row stride for the queries: ld padded to 32 mod 64 halves
        self.lds = self.ld + (32 - self.ld % 64) % 64
        self._smem_ok: dict[int, bool] = {}  # queries per batch -> _mma_smem_ok
        self.smem_per_sm = int(props.get("sharedMemPerMultiprocessor", self.smem_optin))
        # what decides how many blocks of the resident kernel can be on an SM at once
        self.sm_limits = SmLimits(int(props.get("regsPerMultiprocessor", 65536)), self.smem_per_sm,
                                  int(props.get("maxThreadsPerMultiProcessor", 1024)),
                                  int(props.get("reservedSharedMemPerBlock", 1024)))  # fmt: skip
        # mma_filter can take float16 batches: tensor-core m16n8k16 needs compute capability
        # 8.0 (KALOS_MMA=0, or KALOS_THRESHOLD_TOPK=0 for topk_scores everywhere, turn it off)
        self.mma_ok = dtype == "float16" and int(props.get("major", 0)) >= 8
        # the carousel (unless KALOS_CAROUSEL=0): made at its first start_carousel
        self.carousel_k = carousel.KMAX if USE_CAROUSEL and self.mma_ok else 0
        self._car: carousel.Carousel | None = None
        self._direct: DirectSlots | None = None  # the slots the direct clients write (KALOS_CAROUSEL=direct)
        self._car_answered = 0  # the carousel's answers in the launches stopped so far (the lane's and direct)
        self.crowd: CrowdLane | None = None
        self.carousel_running = False
        self.carousel_launches = 0
        self._car_fault = ""  # why the carousel failed ("": it has not): said again by every check
        self._sample_buf: Any = None  # mma_filter's sample scores (MAXQ x TAU_SAMPLE_MAX)
        # the descriptor lives in registered host memory: written by Python, read by prep
        self._desc_mm = mmap.mmap(-1, 4096)
        self._desc_np = np.frombuffer(self._desc_mm, np.uint8)
        self.desc_addr = self._desc_np.ctypes.data
        self._check(lambda: cp.cuda.runtime.hostRegister(self.desc_addr, 4096, 3))
        self._desc_u64 = np.frombuffer(self._desc_mm, np.uint64)
        # select_cands raises this flag (lane 0's, past both lanes' descriptors, same page)
        assert _LANE_DESC[1] + _DESC_SIZE <= _LANE_OVERFLOW[0]
        self._overflow = np.frombuffer(self._desc_mm, np.int32, 1, _LANE_OVERFLOW[0])
        self._overflow_addr = self.desc_addr + _LANE_OVERFLOW[0]
        # int8: candidates land here (registered host memory), then get re-scored into the slot
        self._cand_mm = mmap.mmap(-1, 2 * MAXQ * CAND_MAX * 4)
        cand = np.frombuffer(self._cand_mm, np.int32)
        self.cand_rows = cand[: MAXQ * CAND_MAX].reshape(MAXQ, CAND_MAX)
        self.cand_scores = cand[MAXQ * CAND_MAX :].view(np.float32).reshape(MAXQ, CAND_MAX)
        self.cand_addr = cand.ctypes.data
        self._check(lambda: cp.cuda.runtime.hostRegister(self.cand_addr, len(self._cand_mm), 3))
        self.graphs: dict[tuple[int, ...], Any] = {}
        if dtype == "int8":
            self.exact, self._exact_reg = self._new_exact(0)
            # the resident kernel's int8 candidates (rows and quantized scores, then the
            # re-scoring's hand-out and result records, tagged by request): device
            # memory, as bell_handout / bell_results in kernels/recall.cu lay it out, zeroed
            # before each launch
            with self.device:
                self.bell_cand = cp.empty(_BELL_CAND_WORDS * CAND_MAX, cp.int32)
        # launches left running, oldest first: at most two (a batch queued behind another)
        self._pending: deque[_Pending] = deque()
        self._lanes: list[_Lane | None] = [None, None]
        self.queued_batches = 0  # batches queued behind another (diagnostics and tests)
        self.queued_c = 0  # of which launched by _launch.run (KALOS_QUEUE_C)
        self._queue_c_failed = False  # a plan's first call failed: the CuPy calls from then on
        self._mma_end: Any = None  # the end event of the mma batch just launched (see _run)
        # the resident kernel (doorbell_topk): its control block in registered host memory,
        # its device words, its own stream; enabled by enable_doorbell()
        self._bell_mm = mmap.mmap(-1, 4096)
        self._bell_addr = np.frombuffer(self._bell_mm, np.uint8).ctypes.data
        self._check(lambda: cp.cuda.runtime.hostRegister(self._bell_addr, 4096, 3))
        with self.device:
            self.bell_words = cp.zeros(_BELL_WORDS, cp.uint32)
            self.bell_cfg = cp.zeros(_BELL_SERVED, cp.uint8)  # the kernel's copy of the host's line
            self.bell_spaces = cp.zeros(_BELL_SPACES.size, cp.uint8)  # struct BellSpaces
        self.doorbell_spaces = BELL_SPACES_MAX if BELL_SPACES else 0
        self.doorbell_args = BELL_ARGS_MAX if BELL_FILTERS else 0
        self.bell_served_spaces: tuple[bytes, ...] = ()  # the scopes' args the kernel serves (or last served)
        # the filters' device masks (uint8 per row) the kernel reads, by args: (the rows kept,
        # the high-water mark, the mask, the row table's change they are as of); brought up
        # to date at each start for the scopes it serves then (_bell_mask)
        self._bell_masks: dict[bytes, tuple[np.ndarray, int, Any, int]] = {}
        self.bell_mask_uploads = 0  # masks made whole
        self.bell_mask_follows = 0  # masks brought up to date by the rows changes touched
        # and the selective filters' row lists (use_list), by args: (the rows kept, the device
        # list of them as int32), uploaded again whenever the kept rows are another array
        self._bell_lists: dict[bytes, tuple[np.ndarray, Any]] = {}
        self.bell_list_uploads = 0
        self.bstream = cp.cuda.Stream(non_blocking=True)
        self.doorbell_k = 0  # > 0 once enabled: the largest k the resident kernel answers
        self.doorbell_running = False
        self.doorbell_launches = 0
        self.doorbell_mode = DOORBELL_MODE
        self._served_before = 0  # answered by earlier launches of the resident kernel
        self._bell_layout: Any = None
        self._arena_table = (0, 0, 0, 0)  # registered address, bytes, rows, version of the arena's row table
        self._arena: Any = None  # the ArenaWriter whose table that is
        self._arena_dev: Any = None  # the table's device copy (float kernels; see BELL_ARENA_DEVICE)
        self._arena_dev_of: tuple[int, ...] = ()  # (address, rows, version, changes) it was copied from
        # Diagnostics (benchmarks/gpu_batch_breakdown.py): a list here collects (stage, CUDA
        # event, perf_counter_ns) at each stage of a search; None (the default) costs one test.
        self.trace: list[tuple[str, Any, int]] | None = None
        # KALOS_BATCH_TIMING: per mma batch (queries, device us, launch-to-wait-end us, wait us)
        self.batch_times: list[tuple[int, float, float, float]] | None = [] if BATCH_TIMING else None
        # and per batch queued behind another (queries, pass us, front us, lead us, gap us; see
        # _launch_behind), with the timed end event of the last pass on the index's stream
        self.queued_times: list[tuple[int, float, float, float, float]] | None = [] if BATCH_TIMING else None
        # and the host's clock (perf_counter_ns) around the last queued launch: entered
        # _launch_behind, began its CUDA calls, returned (the dispatcher's "ql_*" phases)
        self.behind_stamps: tuple[int, int, int] | None = None
        self.stamp_behind = HOST_TIMING
        self._pass_end_ev: Any = None
        # the filters' device masks or lists (use_list), kept for read-only candidates arrays
        # (the service's kept answers, Service.eligible_for), the MASKS_KEPT most recently used,
        # by (the array's id, whether a list): (that array, high, the mask or list, whether a
        # list), one answer kept as both where single queries take its list and batches its
        # mask (list_pays); and the last search's (None where it had no kept array)
        self._masks_kept: OrderedDict[tuple[int, bool], tuple[np.ndarray, int, Any, bool]] = OrderedDict()
        self._mask_kept: tuple[np.ndarray, int, Any, bool] | None = None
        self.filter_lists = 0  # host-path searches that scanned a filter's list of rows
        self.lists_declined = 0  # ... and batches that took its mask instead (list_pays)
        self.gemm_stream_note = ""
        self._closed = False
        self.seg_addr = 0
        self.seg_size = 0
        self._mm_ref: Any = None
        self.capacity = 0
        log.info("GPU backend: %s (%s, %d SMs), %s rows of %d (ld %d), %d threads per row",
                 self.name, self.device_name, self.sms, dtype, dim, self.ld, self.tpr)  # fmt: skip

    # ------------------------------------------------------------------ set-up
    def _compile(self) -> None:
        m, t = self.metric, self.ctype
        exprs = [kernels.expression("prep_queries", m), kernels.expression("topk_scores", m),
                 kernels.expression("tau_scores", m), kernels.expression("filter_scores", m),
                 kernels.expression("select_cands", m),
                 kernels.expression("set_rows", t), kernels.expression("move_rows", t),
                 kernels.expression("get_rows", t), "fault_kernel"]  # fmt: skip
        # the scans (of a list of rows too), and the resident kernel without lists and with them
        # (launched only while a selective filter is served: see kernels/recall.cu). The list
        # builds add ~40% to the compile (the development VM's nvcc, float16 cosine, one
        # module: 11.5 -> 15.8 s), so KALOS_FILTER_LIST=0, which never asks for them, leaves them out.
        lists = ("false", "true") if FILTER_LIST else ("false",)
        exprs += [kernels.expression(scan, t, self.tpr, qb, m) for scan in ("scan_topk", "scan_list")[: len(lists)]
                  for qb in (1, 2, 4, 8)]  # fmt: skip
        exprs += [kernels.expression("doorbell_topk", t, self.tpr, m, flag) for flag in lists]
        if self.dtype == "float16":
            # the pass, and the sample's dump (its spread's arithmetic in a build of its own)
            exprs += [kernels.expression("mma_filter", nt, m, *d) for d in ((), ("true",)) for nt in _MMA_NT]
            if USE_CAROUSEL:
                exprs.append(kernels.expression("carousel_topk", carousel.NT, m))
        try:
            kernels.compile_kernels(exprs, self.ordinal)
        except kernels.KernelCompileError as e:
            from .server import EXIT_DEVICE, StartError

            raise StartError(str(e), EXIT_DEVICE) from None

    def _check(self, fn: Any) -> Any:
        """Run a CUDA call; map a sticky error to FatalDeviceError, OOM to IndexCapacityError."""
        cp = self.cp
        try:
            return fn()
        except cp.cuda.memory.OutOfMemoryError as e:
            raise IndexCapacityError(f"out of device memory on {self.name}: {e}") from None
        except cp.cuda.runtime.CUDARuntimeError as e:
            if getattr(e, "status", None) in _STICKY:
                raise FatalDeviceError(f"CUDA error on {self.name}: {e}") from None
            if getattr(e, "status", None) == 2:  # cudaErrorMemoryAllocation
                raise IndexCapacityError(f"out of device memory on {self.name}: {e}") from None
            raise

    def attach_segment(self, mm: Any) -> None:
        """Register the shared segment with the device (mapped): its host addresses become
        device addresses, so kernels read queries from and write results into the slots."""
        self.detach_segment()
        arr = np.frombuffer(mm, np.uint8)
        self.seg_addr, self.seg_size = arr.ctypes.data, arr.nbytes
        self._check(lambda: self.cp.cuda.runtime.hostRegister(self.seg_addr, self.seg_size, 3))
        self._mm_ref = arr

    # ------------------------------------------------------------------ the resident kernel
    def enable_doorbell(self, layout: Any, arena: Any) -> int:
        """Let the resident kernel answer batch-1 recalls from the registered segment (whose
        ``layout`` it is) with documents from ``arena``; returns the largest k it answers (0:
        not available: turned off with ``KALOS_DOORBELL=0``, or no arena). With int8 storage it
        scans ``rescore_factor * k`` candidates and re-scores them from the float16 copy in
        registered host memory, as the host path does. It starts at the first
        :meth:`resume_doorbell`."""
        if not USE_DOORBELL or arena is None or not self.seg_addr:
            self.doorbell_k = 0
            return 0
        self._bell_layout = layout
        self.arena_moved(arena)
        # (an ARENA_ENTRIES answer is 8 + 16 bytes per hit: it must fit the slot's blob)
        self.doorbell_k = min(DOORBELL_MAX_K, layout.max_k, (layout.blob_size - 8) // ENTRY_SIZE)
        if self.exact is not None:  # int8: its candidates must fit the kernel's buffer
            self.doorbell_k = min(self.doorbell_k, CAND_MAX // self.rescore_factor)
        return self.doorbell_k

    def wants_arena(self) -> bool:
        return USE_DOORBELL

    def arena_moved(self, arena: Any) -> None:
        """Register the arena's new row table for the resident kernel (which stops first).
        The old table is still mapped here (the arena keeps a retired version mapped until
        the next move), so it is unregistered before it goes."""
        if not self.wants_arena():
            return
        self.pause_doorbell()
        old, nbytes, _, _ = self._arena_table
        if old:
            with contextlib.suppress(Exception):
                self.cp.cuda.runtime.hostUnregister(old)
            self._arena_table = (0, 0, 0, 0)
        self._arena = None
        if arena is None or arena.buf is None:
            self.doorbell_k = 0  # dropped: documents go inline again
            return
        self._arena = arena
        addr = np.frombuffer(arena.buf, np.uint8).ctypes.data
        nbytes = -(-(ARENA_HEADER_SIZE + ENTRY_SIZE * arena.rows_cap) // 4096) * 4096
        nbytes = min(nbytes, len(arena.buf))
        self._check(lambda: self.cp.cuda.runtime.hostRegister(addr, nbytes, 3))
        self._arena_table = (addr, nbytes, arena.rows_cap, arena.version)

    def pause_doorbell(self) -> None:
        """Stop the resident kernel (it answers the request in hand first) and wait for it;
        the carousel too (:meth:`stop_carousel`): both hold every SM."""
        self.stop_carousel()
        if not self.doorbell_running:
            return
        if self.on_doorbell is not None:
            self.on_doorbell(False)  # clients stop ringing first; a request rung meanwhile is ours
        struct.pack_into("<i", self._bell_mm, 0, 1)
        t_end = time.monotonic() + _DOORBELL_STOP_S
        while not self._check(lambda: self.bstream.done):
            if time.monotonic() > t_end:
                raise FatalDeviceError(f"the resident kernel on {self.name} did not stop within "
                                       f"{_DOORBELL_STOP_S:.0f} s")  # fmt: skip
            time.sleep(0)
        self._check(self.bstream.synchronize)  # raises the kernel's error, if it faulted
        self.doorbell_running = False
        self._served_before += struct.unpack_from("<Q", self._bell_mm, _BELL_SERVED)[0]

    def _arena_on_device(self, table: int, rows: int, version: int) -> int:
        """The device address of a copy of the arena's row table (``rows`` entries at
        ``table``, registered host memory), copied again only if the table changed since."""
        changes = self._arena.changes if self._arena is not None else -1
        key = (table, rows, version, changes)
        if key != self._arena_dev_of or changes < 0:
            nbytes = ENTRY_SIZE * rows
            self._arena_dev_of = ()  # (until the copy below is whole)
            if self._arena_dev is not None and self._arena_dev.nbytes < nbytes:
                self._arena_dev = None  # the old copy's memory first

            def copy() -> None:
                with self.device:  # this device's memory, whichever thread calls (as every allocation here)
                    if self._arena_dev is None:
                        self._arena_dev = self.cp.empty(nbytes, self.cp.uint8)
                    # synchronous (from registered host memory): the kernel starts after it
                    self.cp.cuda.runtime.memcpy(self._arena_dev.data.ptr, table + ARENA_HEADER_SIZE, nbytes, 1)

            self._check(copy)
            self._arena_dev_of = key
        return int(self._arena_dev.data.ptr)

    def check_doorbell(self) -> None:
        """Housekeeping: a resident kernel (or carousel) that ended without being stopped
        faulted; raise its error (FatalDeviceError: the sidecar exits and its supervisor
        restarts it)."""
        self.check_carousel()
        if self.doorbell_running and self._check(lambda: self.bstream.done):
            self.pause_doorbell()

    # ------------------------------------------------------------------ the carousel
    def start_carousel(self, high: int, ns: int = NS_ANY, eligible: int = 0) -> None:
        """Start the carousel over rows [0, ``high``): the resident kernel stopped and every
        search of ours finished first (the carousel holds every SM until it stops). Requests
        go through ``crowd`` (sidecar/crowd.py); their namespace id picks the rows (NS_ANY:
        every row below ``high``, which must then all be live). With direct clients
        (``carousel_direct``, KALOS_CAROUSEL=direct) their slots ask namespace ``ns``, which
        has ``eligible`` rows (the clients check an answer's count against it), and the
        header's carousel epoch turns odd once the kernel runs."""
        if self.carousel_running:
            return
        if not self.carousel_k or self._closed:
            raise RuntimeError(
                f"{self.name} has no carousel (float16 rows on a GPU of compute capability 8.0+ "
                "have one unless KALOS_CAROUSEL=0)"
            )
        self.pause_doorbell()
        self._finish_all()
        # every stream of this device idle (a queued batch's side streams too; the rows' copies:
        # the kernel reads them): a block of ours still running would hold an SM the carousel needs
        self._check(self.device.synchronize)

        def start() -> None:
            with self.device:
                if self._car is None:
                    direct = self.carousel_direct if self.carousel_map is not None else 0
                    mm = None
                    if direct:
                        try:
                            mm = self.carousel_map(CarouselLayout.of(self.dim).segment_size(carousel.MAX_SLOTS))
                        except OSError as e:  # (a full /dev/shm, say): the lane alone, as KALOS_CAROUSEL=1
                            log.warning("no direct slots for the carousel (%s): its recalls come the usual way", e)
                            direct = self.carousel_direct = 0  # (the dispatcher's rules: a lane-only crowd)
                    slots = carousel.Slots(self.cp, carousel.MAX_SLOTS, self.dim, mm)
                    try:
                        self._car = carousel.Carousel(self.cp, self.data, self.dim, self.metric, slots, ns=self.ns,
                                                      sqnorm=self.sqnorm, n_rows=high)  # fmt: skip
                    except BaseException:
                        slots.close()
                        raise
                    if direct:
                        self._direct = DirectSlots(slots.words, direct, self._on_carousel)
                    self.crowd = CrowdLane(slots, self.check_carousel, first=direct)
                else:
                    self._car.retarget(self.data, high, self.ns, self.sqnorm)
                if self._direct is not None:  # the direct clients' namespace (they write k, seq and the query)
                    self._direct.launch(ns, eligible)
                self._car.start()

        try:
            self._check(start)
        except FatalDeviceError:
            raise
        except BaseException:
            if self._car is not None and self._car.running:  # launched, and its stop failed too
                self.carousel_running = True
                self._car_fault = "could not be started, nor stopped"
                raise FatalDeviceError(f"the carousel on {self.name} {self._car_fault}") from None
            raise
        self.carousel_running = True
        self.carousel_launches += 1
        if self._direct is not None:
            self._direct.publish(1)  # (E, odd: the clients may write; sidecar/direct.py has the phases)

    def _on_carousel(self, epoch: int, n: int) -> None:
        if self.on_carousel is not None:  # (the server's, set after the index is made)
            self.on_carousel(epoch, n)

    @property
    def carousel_answered(self) -> int:
        return self._car.answered if self._car is not None else 0

    @property
    def carousel_direct_slots(self) -> int:
        """The carousel slots direct clients write (0: none, or no carousel made yet)."""
        return self._direct.n if self._direct is not None else 0

    def carousel_active(self) -> int:
        return self._direct.active() if self._direct is not None else 0

    def sweep_carousel(self) -> int:
        """With the carousel stopped: the direct slots' requests no kernel will answer (asked
        after a stop's sweep, or abandoned aboard) turned back to IDLE; their clients ask again
        the usual way. Returns how many."""
        car = self._car
        if self._direct is None or car is None or car.running:
            return 0
        return self._direct.sweep()

    def check_carousel(self) -> None:
        """Raise FatalDeviceError if the carousel, running, has ended (it ends only when
        stopped: anything else is a fault, whose error this raises if CUDA has one)."""
        if self._car_fault:
            raise FatalDeviceError(f"the carousel on {self.name} {self._car_fault}")
        car = self._car
        if not self.carousel_running or car is None or not self._check(lambda: car.stream.done):
            return
        self.carousel_running = False
        car.running = False
        self._car_fault = "ended without being stopped"
        try:
            self._check(car.stream.synchronize)
        except Exception as e:  # (any error it ended with: the sidecar restarts all the same)
            self._car_fault = f"ended with {type(e).__name__}: {e}"
        raise FatalDeviceError(f"the carousel on {self.name} {self._car_fault}")

    def stop_carousel(self) -> None:
        """Stop the carousel once it holds no request and none waits to board (a stop abandons
        what is aboard: ``crowd.quiesce`` runs the backlog through first, and keeps the answers
        for the dispatcher's next harvest)."""
        if not self.carousel_running:
            return
        car, crowd = self._car, self.crowd
        assert car is not None and crowd is not None
        if self._direct is not None:
            self._direct.publish(2)  # (E + 1, even: the clients ask the usual way from now on)
            crowd.settle_direct(_CAROUSEL_DRAIN_S)  # (what was asked before they saw it, answered and kept)
        try:
            crowd.quiesce(_DOORBELL_STOP_S)  # (check_carousel, its alive(), raises if the kernel has ended)
        except TimeoutError as e:
            self._car_fault = f"stopped answering: {e}"
            raise FatalDeviceError(f"the carousel on {self.name} {self._car_fault}") from None
        try:
            self._check(lambda: car.stop(_DOORBELL_STOP_S))
        except TimeoutError as e:
            self._car_fault = f"did not stop: {e}"
            raise FatalDeviceError(f"the carousel on {self.name} {self._car_fault}") from None
        finally:
            self.carousel_running = car.running
        self._car_answered += car.answered
        if self._direct is not None:
            self.sweep_carousel()
            self._direct.publish(3)  # (E + 3: from here on the rows may change)
        car.data = car.ns = car.sqnorm = None  # (the rows' arrays not kept alive: a growth frees the old ones)

    def resume_doorbell(self, high: int, ns: int, spaces: Sequence[BellScope] = (),
                        touched_since: Callable[[int], np.ndarray | None] | None = None) -> None:  # fmt: skip
        """(Re)start the resident kernel over rows [0, ``high``) of namespace id ``ns`` (NS_ANY:
        all of them; NS_NONE: the default namespace is empty), serving the recalls of the
        scopes ``spaces`` too (:func:`bell_spaces_table`; none while ``doorbell_spaces`` is 0,
        no filter while ``doorbell_args`` is 0): a filter's through a device mask of the rows it
        keeps (:meth:`_bell_mask`, which ``touched_since`` lets bring an earlier start's mask up
        to date)."""
        if self.doorbell_running or not self.doorbell_k or not self.seg_addr or self._closed:
            return
        self.stop_carousel()  # (both hold every SM)
        self._finish_all()
        scopes = self._bell_entries(spaces, high, touched_since) if self.doorbell_spaces else []
        spaces_table, names = bell_spaces_table(scopes)
        lay = self._bell_layout
        table, _, arena_rows, arena_version = self._arena_table
        entries, mode = table + ARENA_HEADER_SIZE, self.doorbell_mode & ~BELL_ARENA_DEVICE
        if ARENA_COPY and self.exact is None and arena_rows:
            try:
                entries, mode = self._arena_on_device(table, arena_rows, arena_version), mode | BELL_ARENA_DEVICE
            except FatalDeviceError:
                raise
            except Exception:  # no room for the copy (or it failed): the host table, as before
                log.warning("the arena's row table could not be copied to %s; the resident kernel reads "
                            "it from host memory", self.name, exc_info=True)  # fmt: skip
                self._arena_dev, self._arena_dev_of = None, ()
        _BELL_CTL.pack_into(self._bell_mm, 0, 0, high, ns, lay.n_slots, self.seg_addr, lay.slot_offset(0),
                            lay.slot_size, lay.payload_offset, lay.rows_offset, lay.scores_offset,
                            lay.blob_offset, self.dim, self.doorbell_k, entries,
                            arena_rows, mode, arena_version, self._exact_reg,
                            self.rescore_factor if self.exact is not None else 0, len(names),
                            self.bell_spaces.data.ptr if names else 0)  # fmt: skip
        self._bell_mm[_BELL_SERVED : _BELL_SERVED + 8 + _BELL_STAMPS.size] = bytes(8 + _BELL_STAMPS.size)
        cfg = np.frombuffer(self._bell_mm, np.uint8, _BELL_SERVED).copy()
        # (int8: the merge's buffer holds the candidates, then their exact order)
        kp = _pow2(self.doorbell_k * (self.rescore_factor if self.exact is not None else 1))
        buf = self._buf(kp)
        smem = self._smem(1, buf)
        # (the build that serves lists only while one is served: the other's default-namespace
        # recall is faster)
        lists = "true" if any(e[3] >= 0 for e in scopes) else "false"
        kern = kernels.get_kernel("doorbell_topk", self.ctype, self.tpr, self.metric, lists)
        if smem > max(48 * 1024, kern.max_dynamic_shared_size_bytes):
            kern.max_dynamic_shared_size_bytes = smem
        # BELL_PER_SM blocks per SM at most, and never more than can be resident at once: a
        # block that waits for SM room behind blocks that never end would hang it
        regs = int(getattr(kern, "num_regs", 0) or 255)
        static = int(getattr(kern, "shared_size_bytes", 0) or 8192)
        per_sm = resident_blocks_per_sm(self.bell_per_sm, regs, kernels.BLOCK, smem, static, self.sm_limits)
        if per_sm < 1:
            log.warning("the resident kernel does not fit on an SM (%d registers); serving without it", regs)
            self.doorbell_k = 0
            return
        grid = min(self.max_grid, per_sm * self.sms)

        def launch() -> None:
            with self.device, self.bstream:
                self.bell_words.fill(0)
                if self.exact is not None:  # int8: no record tagged by an earlier launch
                    self.bell_cand.fill(0)
                self.bell_cfg.set(cfg, stream=self.bstream)
                if names:
                    self.bell_spaces.set(np.frombuffer(spaces_table, np.uint8), stream=self.bstream)
                i8 = self.exact is not None
                kern((grid,), (kernels.BLOCK,),
                     (self.data, self.ns, self.sqnorm, self.rowscale if i8 else np.uint64(0), self.params,
                      self.qbuf, self.qbuf_i8, np.int32(self.ld), np.int32(buf), self.scratch_k,
                      self.scratch_v, self.sync, np.uint64(self._bell_addr), self.bell_cfg,
                      self.bell_words, self.bell_cand if i8 else np.uint64(0)), shared_mem=smem)  # fmt: skip

        self.stream.synchronize()  # nothing of ours still running on the other stream
        # Say so before the launch (~0.1 ms of host work): a client that rings meanwhile is
        # answered once the kernel starts, where one that saw it stopped would send a REQUEST,
        # and serving that means stopping the kernel again (S5-5: 20 of 300 back-to-back
        # recalls went round that loop). If the launch fails, clients are told at once.
        self.doorbell_running = True
        self.bell_served_spaces = names
        try:
            if self.on_doorbell is not None:
                self.on_doorbell(True)
            self._check(launch)
        except BaseException:
            self.doorbell_running = False
            if self.on_doorbell is not None:
                self.on_doorbell(False)
            raise
        self.doorbell_launches += 1

    def _bell_entries(self, spaces: Sequence[BellScope], high: int,
                      touched_since: Callable[[int], np.ndarray | None] | None = None,
                      ) -> list[tuple[bytes, int, int, int]]:  # fmt: skip
        """:func:`bell_spaces_table`'s quadruples for ``spaces``, each filter's with its list
        of rows where it is selective (:func:`use_list`, :meth:`_bell_list`), else its mask
        (:meth:`_bell_mask`); a filter is left out while ``doorbell_args`` is 0, or where there
        is no room for its mask or list. Masks and lists of scopes no longer served are freed.
        (The kernel is stopped: nothing reads them meanwhile.)"""
        out: list[tuple[bytes, int, int, int]] = []
        masks: dict[bytes, tuple[np.ndarray, int, Any, int]] = {}
        lists: dict[bytes, tuple[np.ndarray, Any]] = {}
        for sc in spaces[:BELL_SPACES_MAX]:
            # a namespace given as its rows (BellScope.whole) is scanned through their list like
            # a selective filter's, or served as the namespace alone where it is not
            listed = sc.rows is not None and bool(self.doorbell_args) and use_list(len(sc.rows), high)
            if sc.rows is None or (sc.whole and not listed):
                out.append((sc.args, sc.ns_id, 0, -1))
                continue
            if not self.doorbell_args or len(sc.args) > self.doorbell_args:
                continue
            try:
                if listed:
                    lists[sc.args] = got = self._bell_list(sc)
                    out.append((sc.args, sc.ns_id, int(got[1].data.ptr), len(got[0])))
                else:
                    masks[sc.args] = kept = self._bell_mask(sc, high, touched_since)
                    out.append((sc.args, sc.ns_id, int(kept[2].data.ptr), -1))
            except MemoryError:  # (CuPy's OutOfMemoryError: that filter goes to the sidecar, as before)
                log.warning("no room for a filter's mask or list on %s; the sidecar answers its recalls",
                            self.name, exc_info=True)  # fmt: skip
                if sc.whole:  # (a namespace: served without its list)
                    out.append((sc.args, sc.ns_id, 0, -1))
                continue
        self._bell_masks, self._bell_lists = masks, lists
        return out

    def _bell_list(self, sc: BellScope) -> tuple[np.ndarray, Any]:
        """The device list (int32, ascending) of the rows the selective filter ``sc`` keeps:
        the one kept from the kernel's last start while it is for the same rows array (the
        service's kept answer, which nobody changes: read-only), else a new one (at most a
        16th of the rows below the high-water mark: 250 KB at 1M rows). Written on the
        kernel's stream, which its launch follows. (A list with no rows is a device array of
        one, which the kernel never reads: its length is 0.)"""
        assert sc.rows is not None
        rows = sc.rows
        kept = self._bell_lists.get(sc.args)
        if kept is not None and kept[0] is rows and not rows.flags.writeable:
            return kept
        with self.device, self.bstream:
            dev = self.cp.asarray(rows.astype(np.int32) if len(rows) else np.zeros(1, np.int32))
        self.bell_list_uploads += 1
        return rows, dev

    def _bell_mask(self, sc: BellScope, high: int, touched_since: Callable[[int], np.ndarray | None] | None,
                   ) -> tuple[np.ndarray, int, Any, int]:  # fmt: skip
        """The device mask (uint8 per row, at least ``high`` of them; 1 where the filter keeps
        the row) of the filter ``sc``: the one kept from the kernel's last start while it is
        for the same rows array (the service's kept answer, which nobody changes: read-only),
        grown with zeros if ``high`` passed its end; else that one brought up to date where
        ``touched_since`` names the rows the changes since it touched, at most
        :data:`BELL_MASK_FOLLOW` or a 512th of ``high``, each set to whether ``sc.rows`` holds
        it (rows no change touched kept their namespace and metadata, so the filter keeps or
        drops them as before: a few bytes written where a whole mask is ~1 MB at 1M rows, made
        on the host in ~0.36 ms on the development VM); else a new one. Written on the
        kernel's stream, which its launch follows."""
        assert sc.rows is not None
        rows = sc.rows
        kept = self._bell_masks.get(sc.args)
        if kept is not None:
            k_rows, _, dev, k_seq = kept
            if k_rows is rows and not rows.flags.writeable:
                # the same kept answer (no row of its namespace changed): only rows past the
                # mask, if the rows grew (a write elsewhere), need a byte, 0
                if len(dev) >= high:
                    return rows, high, dev, sc.seq
                return self._bell_mask_follow(dev, rows, high, sc.seq, rows[:0])
            if touched_since is not None and k_seq >= 0 and sc.seq >= k_seq:
                t = touched_since(k_seq)
                if t is not None and len(t) <= max(BELL_MASK_FOLLOW, high // 512):
                    return self._bell_mask_follow(dev, rows, high, sc.seq, t)
        m = np.zeros(max(high, 1), np.uint8)
        m[rows] = 1
        with self.device, self.bstream:
            dev = self.cp.asarray(m)
        self.bell_mask_uploads += 1
        return rows, high, dev, sc.seq

    def _bell_mask_follow(self, dev: Any, rows: np.ndarray, high: int, seq: int, touched: np.ndarray,
                          ) -> tuple[np.ndarray, int, Any, int]:  # fmt: skip
        """:meth:`_bell_mask`'s update of ``dev`` in place: grown (zeros) to ``high`` rows if
        shorter, and each row of ``touched`` set to whether ``rows`` (ascending) holds it."""
        t = np.unique(touched)
        pos = np.searchsorted(rows, t)
        held = pos < len(rows)
        held[held] = rows[pos[held]] == t[held]
        cp = self.cp
        with self.device, self.bstream:
            if len(dev) < high:
                grown = cp.zeros(high, np.uint8)
                grown[: len(dev)] = dev
                dev = grown
            t_in = t < len(dev)  # (a row past the mask: removed, and the mask was never that long)
            if t_in.any():
                dev[cp.asarray(t[t_in])] = cp.asarray(held[t_in].astype(np.uint8))
        self.bell_mask_follows += 1
        return rows, high, dev, seq

    def doorbell_stamps(self) -> tuple[int, ...]:
        """The resident kernel's diagnostics (benchmarks/doorbell_probe.py): GPU clock (ns) of
        its last answer's request taken, blocks started, merge done, answered; when polling for
        it began and how many polls it took; when it saw its last stop and after how many polls;
        when block 0 began and when the last block returned (BellCtl::stamp in kernels/recall.cu)."""
        return _BELL_STAMPS.unpack_from(self._bell_mm, _BELL_SERVED + 8)

    def doorbell_served(self) -> int:
        """Recalls the resident kernel answered (all launches)."""
        now = struct.unpack_from("<Q", self._bell_mm, _BELL_SERVED)[0] if self.doorbell_running else 0
        return self._served_before + now

    def detach_segment(self) -> None:
        with contextlib.suppress(Exception):
            self.pause_doorbell()
        if self.seg_addr and (self.doorbell_running or self.carousel_running):
            # a resident kernel that would not stop: waiting for the device would hang, and
            # unregistering memory it reads could fault it; the process's exit frees both
            log.error("a resident kernel on %s did not stop; the segment stays registered", self.name)
            self.seg_addr, self.seg_size, self._mm_ref = 0, 0, None
        if self.seg_addr:
            with contextlib.suppress(Exception):
                self._finish_all()  # the searches in flight write into the segment
            with contextlib.suppress(Exception):
                self._pending.clear()
                self.device.synchronize()  # every stream (a queued batch's side streams too)
                self.cp.cuda.runtime.hostUnregister(self.seg_addr)
            self.seg_addr, self.seg_size, self._mm_ref = 0, 0, None

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        nbytes = self.data.nbytes + self.ns.nbytes + self.sqnorm.nbytes
        if self.rowscale is not None:
            nbytes += self.rowscale.nbytes
        d.update(backend=self.name, device=self.device_name, device_bytes=int(nbytes),
                 threads_per_row=self.tpr, ld=self.ld, graphs=len(self.graphs),
                 gemm_path=USE_GEMM, mma_path=USE_MMA and USE_THRESHOLD_TOPK and self.mma_ok,
                 gemm_stream=self.gemm_stream_note or "ordered",
                 threshold_topk=USE_THRESHOLD_TOPK, threshold_overflows=self.threshold_overflows,
                 mma_batches=self.mma_batches, queued_batches=self.queued_batches, queued_c=self.queued_c,
                 doorbell_k=self.doorbell_k, doorbell_running=self.doorbell_running,
                 doorbell_launches=self.doorbell_launches, doorbell_served=self.doorbell_served(),
                 doorbell_spaces=scope_names(self.bell_served_spaces)[0],
                 doorbell_filters=scope_names(self.bell_served_spaces)[1],
                 bell_mask_uploads=self.bell_mask_uploads, bell_mask_follows=self.bell_mask_follows,
                 bell_list_uploads=self.bell_list_uploads, filter_lists=self.filter_lists,
                 lists_declined=self.lists_declined,
                 carousel_k=self.carousel_k, carousel_running=self.carousel_running,
                 carousel_launches=self.carousel_launches,
                 carousel_boarded=self.crowd.boarded if self.crowd is not None else 0,
                 carousel_answered=self._car_answered + (self.carousel_answered if self.carousel_running else 0),
                 carousel_direct=self.carousel_direct_slots)  # fmt: skip
        if self.batch_times:
            t = np.array(self.batch_times)
            cols = ((1, "device"), (2, "launch_to_ready"), (3, "wait"))
            kinds = (("p50", np.median), ("mean", np.mean))
            d["batch_timing"] = {"batches": len(t), "queries_mean": round(float(t[:, 0].mean()), 2),
                                 **{f"{name}_{kind}_us": round(float(f(t[:, j])), 1)
                                    for j, name in cols for kind, f in kinds}}  # fmt: skip
        if self.queued_times:
            d["queued_timing"] = queued_timing(self.queued_times)
        return d

    # ------------------------------------------------------------------ rows
    def reserve(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        self._finish_all()  # the arrays below may be replaced
        per_row = self.ld * np.dtype(self.np_dtype).itemsize + 8 + (4 if self.rowscale is not None else 0)
        cap = max(capacity, 2 * self.capacity, 1024)
        if self.memory_limit is not None and cap * per_row > self.memory_limit:
            cap = capacity  # doubling would not fit: grow to exactly what is needed
            if cap * per_row > self.memory_limit:
                raise IndexCapacityError(
                    f"growing to {cap} rows needs {cap * per_row / 2**30:.3f} GiB of device "
                    f"memory, over the limit of {self.memory_limit / 2**30:.3f} GiB "
                    "(KALOS_GPU_MEMORY_LIMIT)"
                )
        cp, old = self.cp, self.capacity
        ex: np.ndarray | None = None
        reg = 0
        if self.exact is not None:
            # int8's float16 copy first: registering it pins it and can fail, and nothing may
            # have changed then (the device arrays below are swapped in as they are made)
            self.pause_doorbell()  # (stopped already when rows change) it reads the old copy
            ex, reg = self._new_exact(cap)

        def grow() -> None:
            with self.device, self.stream:
                data = cp.zeros((cap, self.ld), self.np_dtype)
                ns = cp.full(cap, -1, cp.int32)
                sq = cp.zeros(cap, cp.float32)
                rs = cp.zeros(cap, cp.float32) if self.rowscale is not None else None
                if old:
                    data[:old] = self.data
                    ns[:old] = self.ns
                    sq[:old] = self.sqnorm
                    if rs is not None:
                        rs[:old] = self.rowscale
                self.stream.synchronize()
            self.data, self.ns, self.sqnorm, self.rowscale = data, ns, sq, rs

        try:
            self._check(grow)
        except BaseException:
            if reg:
                with contextlib.suppress(Exception):
                    cp.cuda.runtime.hostUnregister(reg)
            raise
        if ex is not None and self.exact is not None:
            ex[:old] = self.exact[:old]
            self._drop_exact()
            self.exact, self._exact_reg = ex, reg
        self.capacity = cap
        self.graphs.clear()  # they captured the old arrays' addresses

    def _new_exact(self, cap: int) -> tuple[np.ndarray, int]:
        """int8: a zeroed float16 copy of ``cap`` rows (``ld`` wide) in page-aligned host memory,
        registered with the device (mapped) when the resident kernel may read it, which it does
        for the rows of its candidates only (~1.5 KB each at 768-d). Returns it and its
        registered address (0: not registered)."""
        nbytes = cap * self.ld * 2
        mm = mmap.mmap(-1, max(4096, -(-nbytes // 4096) * 4096))
        arr = np.frombuffer(mm, np.float16, cap * self.ld).reshape(cap, self.ld)
        if not (USE_DOORBELL and cap):
            return arr, 0
        addr = np.frombuffer(mm, np.uint8).ctypes.data
        self._check(lambda: self.cp.cuda.runtime.hostRegister(addr, len(mm), 3))
        return arr, addr

    def _drop_exact(self) -> None:
        """Unregister the float16 copy before its memory goes (an address reused by a later
        mapping must not still be registered)."""
        if self._exact_reg:
            with contextlib.suppress(Exception):
                self.cp.cuda.runtime.hostUnregister(self._exact_reg)
            self._exact_reg = 0

    def set_rows(self, rows: np.ndarray, vectors: np.ndarray, ns: np.ndarray) -> None:
        if not len(rows):
            return
        self._finish_all()  # a search in flight answers from the rows as they were
        self.reserve(int(rows.max()) + 1)
        cp = self.cp
        # same row twice in one batch: keep the last write only (the kernel runs rows in parallel)
        _, last = np.unique(rows[::-1], return_index=True)
        keep = np.sort(len(rows) - 1 - last)
        rows, vectors, ns = rows[keep], vectors[keep], ns[keep]

        def run() -> None:
            with self.device, self.stream:
                src = cp.asarray(np.ascontiguousarray(vectors, np.float32))
                r = cp.asarray(rows.astype(np.int64))
                rs = self.rowscale if self.rowscale is not None else None
                kernels.get_kernel("set_rows", self.ctype)(
                    (len(rows),), (kernels.BLOCK,),
                    (src, r, np.int32(len(rows)), np.int32(self.dim), np.int32(self.ld), self.data,
                     self.sqnorm, rs if rs is not None else np.uint64(0)),
                )  # fmt: skip
                self.ns[r] = cp.asarray(ns.astype(np.int32))
                self.stream.synchronize()

        self._check(run)
        if self.exact is not None:
            self.exact[rows, : self.dim] = vectors

    def clear_rows(self, rows: np.ndarray) -> None:
        if not len(rows):
            return
        self._finish_all()

        def run() -> None:
            with self.device, self.stream:
                self.ns[self.cp.asarray(rows.astype(np.int64))] = -1
                self.stream.synchronize()

        self._check(run)

    def move_rows(self, src: np.ndarray, dst: np.ndarray) -> None:
        if not len(src):
            return
        self._finish_all()
        cp = self.cp

        def run() -> None:
            with self.device, self.stream:
                rs = self.rowscale if self.rowscale is not None else np.uint64(0)
                kernels.get_kernel("move_rows", self.ctype)(
                    (len(src),), (kernels.BLOCK,),
                    (self.data, self.ns, self.sqnorm, rs, cp.asarray(src.astype(np.int64)),
                     cp.asarray(dst.astype(np.int64)), np.int32(len(src)), np.int32(self.ld)),
                )  # fmt: skip
                self.stream.synchronize()

        self._check(run)
        if self.exact is not None:
            self.exact[dst] = self.exact[src]

    def vectors(self, rows: np.ndarray) -> np.ndarray:
        # (no finish_slots: a search in flight does not change rows, get_rows is ordered after
        # it on the stream, and its wait belongs to the batch that launched it)
        if self.exact is not None:
            return self.exact[rows, : self.dim].astype(np.float32)
        cp = self.cp

        def run() -> np.ndarray:
            with self.device, self.stream:
                out = cp.empty((len(rows), self.dim), cp.float32)
                kernels.get_kernel("get_rows", self.ctype)(
                    (len(rows),), (kernels.BLOCK,),
                    (self.data, np.uint64(0), cp.asarray(rows.astype(np.int64)),
                     np.int32(len(rows)), np.int32(self.dim), np.int32(self.ld), out),
                )  # fmt: skip
                host = cp.asnumpy(out, stream=self.stream)
                self.stream.synchronize()
                return host

        return self._check(run)

    # ------------------------------------------------------------------ search
    def _grid(self, high: int, kp: int, listed: bool = False) -> int:
        """Blocks for a scan of ``high`` rows: two rounds of each block's groups, within the
        device's and the merge's bounds. ``listed``: a list's length, which differs from filter
        to filter, rounded up to a power of two so that its graphs, one per grid (and per slot
        and k), stay few: at most one more block per block needed, each without rows to read."""
        groups = kernels.BLOCK // self.tpr
        g = -(-high // (2 * groups))
        if listed:
            g = _pow2(g)
        return max(1, min(self.max_grid, g, max(1, 16384 // kp)))

    def _buf(self, kp: int) -> int:
        return _pow2(kp + MERGE_UNROLL * kernels.BLOCK)  # k plus one round of the merge

    def _smem(self, qb: int, buf: int) -> int:
        return qb * self.ld * 4 + qb * buf * 8

    def _fused_qb(self, n: int, kp: int) -> int:
        qb = _pow2(n)
        while qb > 1 and self._smem(qb, self._buf(kp)) > self.smem_optin:
            qb //= 2
        return qb

    def _graph(self, k: int, qb: int, grid: int, slot: tuple[int, int, int] = (0, 0, 0),
               listed: bool = False) -> Any:  # fmt: skip
        """The captured prep + scan graph for (k, queries bucket, grid), and for one query from
        one slot (``slot`` = its query, rows and scores addresses, baked into the launch so
        prep reads the descriptor and the query in one PCIe round trip); ``listed``: the scan
        of a list of rows (scan_list, for a descriptor whose ns id is NS_LIST)."""
        key = (k, qb, grid, *slot, listed)
        g = self.graphs.get(key)
        if g is not None:
            return g
        if len(self.graphs) >= GRAPH_CACHE:
            self.graphs.clear()
        kp = _pow2(k)
        buf = self._buf(kp)
        smem = self._smem(qb, buf)
        prep = kernels.get_kernel("prep_queries", self.metric)
        scan = kernels.get_kernel("scan_list" if listed else "scan_topk", self.ctype, self.tpr, qb, self.metric)
        if smem > max(48 * 1024, scan.max_dynamic_shared_size_bytes):
            scan.max_dynamic_shared_size_bytes = smem
        rs = self.rowscale if self.rowscale is not None else np.uint64(0)
        s = self.stream
        with self.device, s:
            s.begin_capture()
            try:
                # a query baked in: one block; a batch: one per query (kernels/recall.cu)
                prep((1 if any(slot) else qb,), (kernels.BLOCK,),
                     (np.uint64(self.desc_addr), self.params, self.qbuf, self.qbuf_h,
                      self.qbuf_i8, np.int32(self.dim), np.int32(self.ld), *map(np.uint64, slot)))  # fmt: skip
                scan((grid,), (kernels.BLOCK,),
                     (self.data, self.ns, self.sqnorm, rs, self.params, self.qbuf, self.qbuf_i8,
                      np.int32(self.ld), np.int32(buf), self.scratch_k, self.scratch_v,
                      self.sync), shared_mem=smem)  # fmt: skip
            finally:
                g = s.end_capture()
        self.graphs[key] = g
        return g

    def _write_desc(self, k: int, high: int, ns: int, mask_addr: int, qs: list[int],
                    rows: list[int], scores: list[int], out_ld: int, off: int = 0) -> None:  # fmt: skip
        """Fill the descriptor at byte ``off`` of its page (lane 1's at 2048)."""
        n = len(qs)
        _DESC_HEAD.pack_into(self._desc_mm, off, n, k, high, ns, mask_addr, out_ld, 0)
        u, w = self._desc_u64, off // 8
        u[w + _DESC_Q // 8 : w + _DESC_Q // 8 + n] = qs
        u[w + _DESC_ROWS // 8 : w + _DESC_ROWS // 8 + n] = rows
        u[w + _DESC_SCORES // 8 : w + _DESC_SCORES // 8 + n] = scores

    def _addresses(self, specs: list[SlotSpec]) -> tuple[list[int], list[int], list[int], int]:
        """Every query's address, and where its rows and scores go, in the order of ``specs``;
        and the rows' stride (results per query). (A batch-1 member's are its spec's own: with
        32 client processes every queued launch has ~15 of them, and the general way cost
        ~25 µs of the launch under cProfile, S30-4.)"""
        qs, rows, scores = [], [], []
        q_ld = 4 * self.dim
        for s in specs:
            n = len(s.queries)
            if n == 1:
                qs.append(s.q_addr)
                rows.append(s.rows_addr)
                scores.append(s.scores_addr)
                continue
            r_ld, s_ld = 4 * s.rows.shape[1], 4 * s.scores.shape[1]
            qs += [s.q_addr + q_ld * j for j in range(n)]
            rows += [s.rows_addr + r_ld * j for j in range(n)]
            scores += [s.scores_addr + s_ld * j for j in range(n)]
        return qs, rows, scores, specs[0].rows.shape[1]

    def search_slots(
        self, specs: list[SlotSpec], k: int, high: int, ns: int,
        candidates: np.ndarray | None, dense: bool,
    ) -> None:  # fmt: skip
        self.launch_slots(specs, k, high, ns, candidates, dense)
        self.finish_slots()

    @property
    def defers(self) -> bool:
        return self.exact is None and bool(self.seg_addr)  # int8 re-scores on the host

    def finish_slots(self) -> None:
        """Wait for the oldest search :meth:`launch_slots` left running (and run the GEMM
        path's fallback top-k if its candidate lists overflowed)."""
        if self._pending:
            self._check(self._pending.popleft().wait)

    def _finish_all(self) -> None:
        while self._pending:
            self.finish_slots()

    def pending_done(self) -> bool:
        """Whether the device has finished the oldest search left running (False when none is,
        or when it is not known without waiting)."""
        if not self._pending or self._pending[0].end is None:
            return False
        return bool(self._check(lambda: self._pending[0].end.done))

    def queues_behind(self, n: int, k: int, high: int) -> bool:
        """Whether :meth:`launch_slots` of ``n`` queries (``k`` results each, rows below
        ``high``, no filter mask) with ``behind=True`` would queue them behind the search left
        running, without waiting for it: float16 rows through mma_filter, the search left
        running one the index can tell the end of, at most one of them."""
        if not (QUEUE_BEHIND and self.seg_addr and self.mma_ok and USE_MMA and USE_THRESHOLD_TOPK):
            return False
        if len(self._pending) != 1 or self._pending[0].end is None or not 1 <= n <= MAXQ:
            return False
        sample = self._tau_sample(k, high)
        return sample is not None and self._mma_smem_ok(n)

    def wants_rows(self, count: int, high: int) -> bool:
        """Where its rows would be scanned as a list (:func:`use_list`: at most a 16th of the
        rows by default, in an index of at least :data:`LIST_MIN_ROWS`): a namespace's scan
        otherwise walks every row below ``high`` (S52-4, 1M rows: ~90 µs for a scope of 1%,
        where its list took ~38)."""
        return use_list(count, high)

    def _mask_is_cheaper(self, n: int, kept: int, high: int) -> bool:
        """Whether a batch of ``n`` queries that :func:`use_list` would scan through a list of
        ``kept`` rows is answered for less through a mask (:func:`list_pays`): only where the
        mask's batch takes the GEMM / mma pass. int8, ``KALOS_GEMM=0`` and batches below
        ``KALOS_GEMM_MIN_Q`` take fused launches through a mask too, walking every row: the
        list stays; so does a list longer than CAND_CAP."""
        gemm = USE_GEMM and self.dtype != "int8" and n >= GEMM_MIN_Q
        # (kept <= CAND_CAP: a longer list's rows may be one block the threshold's sample
        # misses, tau_sample, and then the mask's batch overflows into the exact fallback, ~ms)
        return gemm and kept <= CAND_CAP and not list_pays(n, kept, high)

    def launch_slots(
        self, specs: list[SlotSpec], k: int, high: int, ns: int,
        candidates: np.ndarray | None, dense: bool, behind: bool = False,
    ) -> None:  # fmt: skip
        """Start the search; its last launch (the slot's graph for one query, the GEMM path
        for a float batch without a filter) is left running for :meth:`finish_slots`. Anything
        launched earlier is finished first (the launches share the descriptor, the scratch
        buffers and the overflow flag), unless ``behind``: then the batch is queued behind the
        search left running, in the other lane's buffers (:meth:`queues_behind` must have said
        it can be; ``finish_slots`` then finishes the two in launch order)."""
        if behind:
            n = sum(len(s.queries) for s in specs)
            if candidates is not None or not self.queues_behind(n, k, high):
                raise RuntimeError("launch_slots(behind=True) for a search that cannot queue behind")
            self._launch_behind(k, high, NS_ANY if dense else ns, n, specs=specs)
            return
        self._finish_all()
        self._pass_end_ev = None  # what runs next on the stream may not be a timed pass
        if not self.seg_addr:  # no segment registered (direct use): the host path
            super().search_slots(specs, k, high, ns, candidates, dense)
            return
        qs, rows, scores, out_ld = self._addresses(specs)
        mask_dev = None
        listed = candidates is not None and use_list(len(candidates), high)
        if listed and self._mask_is_cheaper(sum(len(s.queries) for s in specs), len(candidates), high):  # type: ignore[arg-type]
            listed = False
            self.lists_declined += 1
        key = (id(candidates), listed)
        kept = self._masks_kept.get(key) if candidates is not None else None
        if (kept is not None and kept[0] is candidates and kept[1] == high
                and kept[3] == listed):  # fmt: skip  (a mask is never read as a list, nor a list as a mask)
            mask_dev = kept[2]  # (the same filter's answer again, its rows unchanged: uploaded once)
            self._masks_kept.move_to_end(key)
            self._mask_kept = kept
        elif candidates is not None:
            if listed:  # a selective filter: the list of its rows (scan_list walks only them)
                m = candidates.astype(np.int32) if len(candidates) else np.zeros(1, np.int32)
            else:
                m = np.zeros(high, np.uint8)
                m[candidates] = 1
            # uploaded on our stream: on the legacy default stream (outside the context) the
            # copy from pageable memory could still be in flight when the scan reads it
            with self.device, self.stream:
                mask_dev = self.cp.asarray(m)
            # a read-only array is the service's kept answer, which nobody changes: the mask or
            # list stays right for it while ``high`` does (the array held, so its id is not reused)
            self._mask_kept = None
            if not candidates.flags.writeable:
                self._mask_kept = self._masks_kept[key] = (candidates, high, mask_dev, listed)
                self._masks_kept.move_to_end(key)
                while len(self._masks_kept) > MASKS_KEPT:
                    self._masks_kept.popitem(last=False)
        mask_addr = 0 if mask_dev is None else mask_dev.data.ptr
        if listed:  # the list's rows, each eligible: no namespace to check
            assert candidates is not None
            high, ns = len(candidates), NS_LIST
            self.filter_lists += 1
        if self.exact is None:
            # with a filter mask (a device array this call owns) the search finishes here
            self._run(qs, rows, scores, k, high, ns, mask_addr, out_ld, dense and mask_dev is None,
                      defer=mask_dev is None)  # fmt: skip
        else:  # int8: kc candidates per query into the scratch, then exact re-scoring
            kc = min(self.rescore_factor * k, max(high, 1), CAND_MAX)
            flat = [(s, j) for s in specs for j in range(len(s.queries))]
            for start in range(0, len(flat), MAXQ):
                part = flat[start : start + MAXQ]
                cr = [self.cand_addr + 4 * CAND_MAX * j for j in range(len(part))]
                cs = [a + 4 * MAXQ * CAND_MAX for a in cr]
                self._run(qs[start : start + MAXQ], cr, cs, kc, high, ns, mask_addr, CAND_MAX)
                self._rescore(part, k, kc)
        if self.fault_inject == "illegal_address":
            self._inject_fault()
        del mask_dev

    @property
    def queues_from_slots(self) -> bool:  # type: ignore[override]
        """Where the C launch is there (its descriptor from slot numbers: ~1 µs; in Python,
        from a table of addresses, ~25 µs per ~15 members, more than from their specs)."""
        return _c_launch()

    def launch_behind_slots(self, slots: list[int], table: np.ndarray, k: int, high: int, ns: int) -> None:
        """:meth:`launch_slots` with ``behind=True`` for one query per slot of ``slots`` (the
        dispatcher's batch-1 members; their slot numbers, not their specs), each slot's query,
        rows and scores addresses in row ``slot`` of ``table`` (u64, one row of three per slot of
        the registered segment), over the rows below ``high`` in namespace ``ns`` (NS_ANY:
        every row). The descriptor is written and the CUDA calls made in C where _launch is
        built (KALOS_QUEUE_C): ~1 µs for what took ~25 µs of Python per ~15 members."""
        n = len(slots)
        if not self.queues_behind(n, k, high):
            raise RuntimeError("launch_behind_slots for a search that cannot queue behind")
        self._launch_behind(k, high, ns, n, slots=slots, table=table)

    def _behind_parts(self, i: int, lane: _Lane, n: int, k: int, sample: int) -> tuple[Any, Any, Any, bytes | None]:
        """The three graphs of a batch of ``n`` queries queued in lane ``i`` (front: prep,
        sample and thresholds; the pass; the selection) and the plan of their CUDA calls for
        _launch.run (None where it cannot be made: see :meth:`_queue_plan`), captured once."""
        key = (-2, i, n, k, sample)
        parts = self.graphs.get(key)
        if parts is not None:
            return parts
        launches = self._mma_launches(n, k, sample, lane, SIDE_RESERVE)
        assert launches is not None
        if len(self.graphs) >= GRAPH_CACHE:
            self.graphs.clear()
        captured = []

        def capture(group: tuple) -> None:
            with self.device, self.stream:
                self.stream.begin_capture()
                try:
                    for _, launch in group:
                        launch()
                finally:
                    captured.append(self.stream.end_capture())

        for group in (launches[:3], launches[3:4], launches[4:]):
            self._check(lambda g=group: capture(g))
        parts = self.graphs[key] = (*captured, self._queue_plan(captured, lane))
        return parts

    def _queue_plan(self, graphs: list[Any], lane: _Lane) -> bytes | None:
        """The queued launch's eight CUDA calls as _launch.run's plan: the front on the lane's
        side stream and its end recorded; the index's stream waits for it, runs the pass and
        records its end; the side stream waits for that and runs the selection, then records
        ``lane.done``. None without _launch, with KALOS_QUEUE_C=0, where the driver's functions
        cannot be found or a graph has no executable handle: the calls are then made through
        CuPy, as with the timing's events or a trace."""
        fns = _driver_calls() if _c_launch() else None
        if fns is None:
            return None
        execs = []
        with self.device:  # (where CuPy's launch would instantiate it)
            for g in graphs:
                instantiate = getattr(g, "_ensure_instantiate", None)  # (CuPy may instantiate lazily)
                if instantiate is not None:
                    self._check(instantiate)
                execs.append(int(getattr(g, "graphExec", 0) or 0))
        if not all(execs):
            return None
        c = _launch.CONSTANTS
        graph, record, wait = c["OP_GRAPH"], c["OP_RECORD"], c["OP_WAIT"]
        front, pas, sel = execs
        side, main = lane.side.ptr, self.stream.ptr
        fd, pd, done = lane.front_done.ptr, lane.pass_done.ptr, lane.done.ptr
        ops = [(graph, front, side), (record, fd, side), (wait, main, fd), (graph, pas, main),
               (record, pd, main), (wait, side, pd), (graph, sel, side), (record, done, side)]  # fmt: skip
        return np.array([*fns, len(ops), *(x for op in ops for x in op)], np.uint64).tobytes()

    def _launch_behind(self, k: int, high: int, ns: int, n: int, specs: list[SlotSpec] | None = None,
                       slots: list[int] | None = None, table: np.ndarray | None = None) -> None:  # fmt: skip
        """Queue a batch of ``n`` queries behind the search left running (see launch_slots), in
        the lane that search does not hold: ``specs``' queries, or one per slot of ``slots``
        (see launch_behind_slots). On the device: prep, sample and thresholds on the lane's
        side stream (in the block slots the running pass leaves free), the pass on the index's
        stream after both that side work and everything before it, the selection on the side
        stream after the pass."""
        t_in = time.perf_counter_ns()
        i = 1 - self._pending[-1].lane
        lane = self._check(lambda: self._lane(i))
        sample = self._tau_sample(k, high)
        assert sample is not None
        front, pas, sel, plan = self._behind_parts(i, lane, n, k, sample)
        if slots is not None:
            assert table is not None
            self._write_desc_slots(i, k, high, ns, slots, table, _c_launch())
        else:
            assert specs is not None
            qs, rows, scores, out_ld = self._addresses(specs)
            self._write_desc(k, high, ns, 0, qs, rows, scores, out_ld, lane.desc_off)
            lane.overflow[0] = 0
        main, side = self.stream, lane.side
        mark = self._mark_on
        timed = self.queued_times is not None and len(self.queued_times) < 1_000_000
        prev_end = self._pass_end_ev
        t_cuda = time.perf_counter_ns()
        # KALOS_BATCH_TIMING: the front's start and end on the side stream, the pass's start
        # (when the stream reaches it: the earlier pass and this front both done) and end
        evs = [self.cp.cuda.Event() for _ in range(4)] if timed else None

        def launch() -> None:
            with self.device:
                mark("front start", side)
                if evs:
                    evs[0].record(side)
                front.launch(side)
                if evs:  # (before front_done / pass_done: lane.done then follows them)
                    evs[1].record(side)
                lane.front_done.record(side)
                mark("front end", side)
                main.wait_event(lane.front_done)
                mark("pass start", main)
                if evs:
                    evs[2].record(main)
                pas.launch(main)
                if evs:
                    evs[3].record(main)
                lane.pass_done.record(main)
                mark("pass end", main)
                side.wait_event(lane.pass_done)
                sel.launch(side)
                lane.done.record(side)
                mark("select end", side)

        if plan is not None and not evs and self.trace is None and not self._queue_c_failed:
            with self.device:
                failed = _launch.run(plan)
            if failed is not None:
                self._queue_call_failed(*failed)
                self._check(launch)  # (nothing was enqueued: the first call failed)
            else:
                self.queued_c += 1
        else:
            self._check(launch)
        self.mma_batches += 1
        self.queued_batches += 1
        if evs:
            self._pass_end_ev = evs[3]
        if self.stamp_behind or evs:
            self.behind_stamps = (t_in, t_cuda, time.perf_counter_ns())

        def done() -> None:
            with self.device:
                lane.done.synchronize()
                if evs:
                    self._time_queued(n, evs, prev_end)
                if lane.overflow[0]:  # (ties, adversarial data): the exact path for this batch
                    self.threshold_overflows += 1
                    # every search still running finishes first: the fallback uses lane 0's
                    # buffers, and a batch queued behind this one may hold them
                    self.device.synchronize()
                    self._pass_end_ev = None  # the fallback runs on the stream: no idle time to time
                    self._gemm_topk(n, k, high, threshold=False, desc_addr=lane.desc_addr)()

        self._pending.append(_Pending(done, i, lane.done))

    def _write_desc_slots(self, i: int, k: int, high: int, ns: int, slots: list[int], table: np.ndarray,
                          c: bool) -> None:  # fmt: skip
        """Lane ``i``'s descriptor for one query per slot of ``slots`` (each slot's addresses
        in its row of ``table``; results ``k`` apart), and its overflow flag cleared: by
        _launch.desc where ``c``, else in Python, byte for byte the same. (The descriptor's
        out_ld is ``k`` here, the specs' row length on their way; no kernel reads it for a
        queued batch: each query's rows and scores have their own addresses.)"""
        if c:
            _launch.desc(self._desc_mm, _LANE_DESC[i], k, high, ns, k, slots, table, _LANE_OVERFLOW[i], MAXQ)
            return
        qs, rows, scores = (table[slots, j].tolist() for j in range(3))
        self._write_desc(k, high, ns, 0, qs, rows, scores, k, _LANE_DESC[i])
        struct.pack_into("<i", self._desc_mm, _LANE_OVERFLOW[i], 0)

    def _queue_call_failed(self, rc: int, at: int) -> None:
        """A CUDA call of _launch.run's plan returned ``rc`` (a CUresult), the ``at``-th of
        the plan. A context error that stops everything, or a call failing after others were
        enqueued (the batch's work half on the device), is fatal. The first call failing
        otherwise (nothing enqueued; e.g. no current context on this thread) turns the C calls
        off, logged once, and the caller makes them through CuPy."""
        # (_STICKY holds the runtime's codes; the driver's are the same numbers for those)
        msg = f"CUDA driver error {rc} in the queued launch's call {at} on {self.name}"
        if rc in _STICKY or at:
            raise FatalDeviceError(msg)
        log.warning("%s; making the queued launches' CUDA calls through CuPy from now on", msg)
        self._queue_c_failed = True

    def _run(self, qs: list[int], rows: list[int], scores: list[int], k: int, high: int,
             ns: int, mask_addr: int, out_ld: int, dense: bool = False,
             defer: bool = False) -> None:  # fmt: skip
        """Launch for every query: the slot's fused graph for one query; for batches (float
        types) GEMM + top-k for up to MAXQ queries per launch, else fused graphs of up to
        FUSED_MAX_Q queries. ``dense``: every row below ``high`` is eligible (the kernels
        then skip the namespace check). ``defer``: leave the last launch running and
        its wait among the pending searches (``self._pending``)."""
        kp = _pow2(k)
        listed = ns == NS_LIST  # (a list of rows: the fused scan's scan_list, never the GEMM paths)
        use_gemm = USE_GEMM and self.dtype != "int8" and len(qs) >= GEMM_MIN_Q and not listed
        step = MAXQ if use_gemm else self._fused_qb(FUSED_MAX_Q, kp)
        if dense:  # the kernels skip reading the namespace array (10-90 us at 1M rows)
            ns = NS_ANY
        for start in range(0, len(qs), step):
            sl = slice(start, start + step)
            n = len(qs[sl])
            graph = None
            if n == 1:  # the hot path: the slot's addresses are baked into its own graph
                _DESC_HEAD.pack_into(self._desc_mm, 0, 1, k, high, ns, mask_addr, out_ld, 0)
                graph = self._graph(k, 1, self._grid(high, kp, listed), (qs[start], rows[start], scores[start]), listed)
            elif not use_gemm:
                self._write_desc(k, high, ns, mask_addr, qs[sl], rows[sl], scores[sl], out_ld)
                graph = self._graph(k, self._fused_qb(n, kp), self._grid(high, kp, listed), listed=listed)
            last = start + step >= len(qs)
            self._mma_end = None
            if graph is None:
                self._write_desc(k, high, ns, mask_addr, qs[sl], rows[sl], scores[sl], out_ld)
                fin = self._check(lambda n=n: self._batch_topk(n, k, high))
            else:
                self._mark("graph start")
                self._check(lambda g=graph: g.launch(self.stream))
                fin = self._graph_done
            if defer and last:
                end = None
                if graph is None and self._mma_end is not None:  # an mma batch: its end event
                    end, self._mma_end = self._mma_end, None
                self._pending.append(_Pending(fin, 0, end))
            else:
                self._check(fin)

    def _graph_done(self) -> None:
        self.stream.synchronize()
        self._mark("graph end")

    def _batch_topk(self, n: int, k: int, high: int) -> Callable[[], None]:
        """A batch of ``n`` queries (described in the descriptor): mma_filter where it applies,
        else cuBLAS. Launches everything; returns the wait."""
        if USE_MMA and USE_THRESHOLD_TOPK and self.mma_ok:
            fin = self._mma_topk(n, k, high)
            if fin is not None:
                return fin
        return self._gemm_topk(n, k, high)

    def _tau_sample(self, k: int, high: int) -> int | None:
        """The threshold's sample of rows for ``k`` results over ``high`` rows (tau_sample)."""
        return tau_sample(k, high)

    def _mma_topk(self, n: int, k: int, high: int) -> Callable[[], None] | None:
        """Float16 batches: the captured graph of prep_queries, mma_filter over a sample
        (scores to a buffer), tau_scores, mma_filter over every row (candidates reaching tau)
        and select_cands. None, having launched nothing, where it does not apply. The wait
        runs the cuBLAS path with topk_scores if a candidate list overflowed (ties,
        adversarial data: then tau let through more than CAND_CAP rows)."""
        sample = self._tau_sample(k, high)
        if sample is None:
            return None
        graph = self._mma_graph(n, k, sample)
        if graph is None:
            return None
        self._overflow[0] = 0
        self._mark("start")
        timed = self.batch_times is not None and len(self.batch_times) < 1_000_000
        ev0 = ev1 = None
        if timed:
            ev0 = self.cp.cuda.Event()
            ev0.record(self.stream)
        graph.launch(self.stream)
        if timed:
            ev1 = self.cp.cuda.Event()
            ev1.record(self.stream)
        end = self.cp.cuda.Event(block=False, disable_timing=True)
        end.record(self.stream)
        self._mma_end = end
        self._pass_end_ev = ev1  # (None unless timed) what a batch queued behind this follows
        t_launch = time.perf_counter_ns()
        self.mma_batches += 1

        def done() -> None:
            with self.device, self.stream:
                t_wait = time.perf_counter_ns()
                # its own end, not the stream's: a batch queued behind it runs on that stream
                end.synchronize()
                if timed:
                    t_end = time.perf_counter_ns()
                    dev = self.cp.cuda.get_elapsed_time(ev0, ev1) * 1000
                    self.batch_times.append((n, dev, (t_end - t_launch) / 1000, (t_end - t_wait) / 1000))  # type: ignore[union-attr]
                self._mark("mma end")
                if self._overflow[0]:
                    self.threshold_overflows += 1
                    self._pass_end_ev = None  # (as in _launch_behind's fallback)
                    self._gemm_topk(n, k, high, threshold=False)()

        return done

    def _time_queued(self, n: int, evs: list[Any], prev_end: Any) -> None:
        """Record a finished queued batch's times (KALOS_BATCH_TIMING) from its four events
        (front start and end, pass start and end) and the end of the pass before it (None if
        that was not timed): lead, how long before that end the batch's front started on the
        device (its launch, near enough); gap, how long the device's stream idled between
        that end and this pass. All four events precede ``lane.done`` in stream order, so
        they are complete when its done() calls this."""
        ms = self.cp.cuda.get_elapsed_time
        front_start, front_end, pass_start, pass_end = evs
        lead = gap = float("nan")
        if prev_end is not None:
            lead = ms(front_start, prev_end) * 1000
            gap = ms(prev_end, pass_start) * 1000
        pass_us, front_us = ms(pass_start, pass_end) * 1000, ms(front_start, front_end) * 1000
        self.queued_times.append((n, pass_us, front_us, lead, gap))  # type: ignore[union-attr]

    def _mma_smem_ok(self, n: int) -> bool:
        """Whether ``n`` queries fit in mma_filter's shared memory (dims near 7200 may not).
        (Remembered per ``n``: asked two or three times per queued batch.)"""
        ok = self._smem_ok.get(n)
        if ok is None:
            nt = next(t for t in _MMA_NT if 8 * t >= n)
            mma = kernels.get_kernel("mma_filter", nt, self.metric)
            ok = self._smem_ok[n] = 8 * nt * self.lds * 2 + mma.shared_size_bytes <= self.smem_optin
        return ok

    def _mma_graph(self, n: int, k: int, sample: int) -> Any:
        """The captured mma path for ``n`` queries, ``k`` and a ``sample`` of rows (None when
        the queries would not fit in shared memory). Row counts are read from the parameters
        prep writes, so the graph serves any number of rows."""
        key = (-1, n, k, sample)
        g = self.graphs.get(key)
        if g is not None:
            return g
        launches = self._mma_launches(n, k, sample, self._lane(0), SIDE_RESERVE if QUEUE_BEHIND else 0)
        if launches is None:
            return None
        if len(self.graphs) >= GRAPH_CACHE:
            self.graphs.clear()
        s = self.stream
        with self.device, s:
            s.begin_capture()
            try:
                for _, launch in launches:
                    launch()
            finally:
                g = s.end_capture()
        self.graphs[key] = g
        return g

    def _lane(self, i: int) -> _Lane:
        lane = self._lanes[i]
        if lane is None:
            lane = self._lanes[i] = _Lane(self, i)
        return lane

    def _mma_launches(self, n: int, k: int, sample: int, lane: _Lane, reserve: int = 0
                      ) -> tuple[tuple[str, Callable[[], None]], ...] | None:  # fmt: skip
        """The mma path's kernel launches in order, each a (stage, launch) pair, on ``lane``'s
        buffers: what :meth:`_mma_graph` captures, what :meth:`_launch_behind` captures in
        three parts, and what ``benchmarks/mma_stages.py`` times one by one. ``reserve``:
        resident block slots the pass leaves free (for up to 16 queries). None where the
        queries would not fit in shared memory."""
        if not self._mma_smem_ok(n):
            return None
        nt = next(t for t in _MMA_NT if 8 * t >= n)
        mma = kernels.get_kernel("mma_filter", nt, self.metric)
        dump = kernels.get_kernel("mma_filter", nt, self.metric, "true")  # the sample's scores
        smem = 8 * nt * self.lds * 2
        prep = kernels.get_kernel("prep_queries", self.metric)
        tau = kernels.get_kernel("tau_scores", self.metric)
        sel = kernels.get_kernel("select_cands", self.metric)
        sel_smem = (CAND_CAP + SELECT_GATHER) * 8
        for kern, need in ((mma, smem), (dump, smem), (tau, sample * 8), (sel, sel_smem)):
            if need > max(48 * 1024, kern.max_dynamic_shared_size_bytes):
                kern.max_dynamic_shared_size_bytes = need
        # blocks resident per SM (registers, shared memory), every SM filled once: each warp
        # then streams tiles of 16 or 32 rows (one or two m16 tiles, by batch size) to the end
        by_regs = 65536 // (max(1, mma.num_regs) * kernels.BLOCK)
        by_smem = self.smem_per_sm // (smem + 1024 + 1024)
        grid = max(1, min(by_regs, by_smem, 8)) * self.sms
        if nt == _MMA_NT[0]:  # (larger batches keep every slot: fewer blocks per SM there)
            grid = max(self.sms, grid - reserve)
        warps = kernels.BLOCK // 32
        dump_rows = min(sample, self.capacity)
        dump_grid = max(1, -(-dump_rows // (16 * warps)))  # warp tiles of 16 or 32 rows
        common = (self.data, np.int32(self.ld), np.int32(self.lds))
        ln = lane
        rest = (self.ns, self.sqnorm, ln.params, ln.qbuf_h, ln.tau, ln.cand_k, ln.cand_v,
                ln.cand_count, np.int32(CAND_CAP))  # fmt: skip
        return (
            ("prep", lambda: prep((n,), (kernels.BLOCK,), (np.uint64(ln.desc_addr), ln.params, ln.qbuf,
                                                           ln.qbuf_h, ln.qbuf_i8, np.int32(self.dim),
                                                           np.int32(self.ld), np.uint64(0), np.uint64(0),
                                                           np.uint64(0)))),
            ("sample", lambda: dump((dump_grid,), (kernels.BLOCK,), (*common, np.int32(dump_rows), *rest,
                                                                     ln.sample_buf, np.int32(sample)),
                                    shared_mem=smem)),
            ("tau", lambda: tau((n,), (kernels.BLOCK,), (ln.sample_buf, np.int32(sample), self.ns,
                                                         self.sqnorm, ln.params, np.int32(sample), ln.tau,
                                                         np.int32(1)),
                                shared_mem=sample * 8)),
            ("pass", lambda: mma((grid,), (kernels.BLOCK,), (*common, np.int32(-1), *rest, np.uint64(0),
                                                             np.int32(0)), shared_mem=smem)),
            ("select", lambda: sel((n,), (kernels.BLOCK,), (ln.cand_k, ln.cand_v, ln.cand_count,
                                                            np.int32(CAND_CAP), ln.params,
                                                            np.uint64(ln.overflow_addr)),
                                   shared_mem=sel_smem)),
        )  # fmt: skip

    def _gemm_topk(self, n: int, k: int, high: int, threshold: bool = True,
                   desc_addr: int = 0) -> Callable[[], None]:  # fmt: skip
        """Large batches: scores = Q @ data[:high].T by cuBLAS (tensor cores for float16), then
        a per-query top-k that writes into the slots. Launches everything; returns the wait
        (which runs topk_scores if the threshold top-k's candidate lists overflowed).
        ``threshold=False``: topk_scores at once (the mma path's lists overflowed).
        ``desc_addr``: the descriptor to read (default: lane 0's)."""
        cp = self.cp
        from cupy_backends.cuda.libs import cublas

        with self.device, self.stream:
            self._mark("start")
            kernels.get_kernel("prep_queries", self.metric)(
                (n,), (kernels.BLOCK,), (np.uint64(desc_addr or self.desc_addr), self.params, self.qbuf,
                                         self.qbuf_h, self.qbuf_i8, np.int32(self.dim),
                                         np.int32(self.ld), np.uint64(0), np.uint64(0),
                                         np.uint64(0)))  # fmt: skip
            scores = cp.empty((n, high), cp.float32)
            data = self.data
            qsrc = self.qbuf_h if self.dtype == "float16" else self.qbuf
            atype = _CUDA_R_16F if self.dtype == "float16" else _CUDA_R_32F
            handle = cp.cuda.device.get_cublas_handle()
            cublas.setStream(handle, self.stream.ptr)
            # CuPy's gemmEx wrapper may re-point the handle at what CuPy takes for the current
            # stream (the legacy default stream does not wait for our non-blocking one); this
            # path once returned wrong rows, cause unconfirmed. So: prep is complete before the
            # GEMM starts, and if cuBLAS ran on another stream, the whole device before top-k.
            self._mark("prep")
            self.stream.synchronize()
            self._mark("prep synced")
            one, zero = np.array(1.0, np.float32), np.array(0.0, np.float32)
            # row-major scores (n, high) = column-major (high, n) = data^T(high x ld) . Q^T
            cublas.gemmEx(handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, high, n, self.ld,
                          one.ctypes.data, data.data.ptr, atype, self.ld,
                          qsrc.data.ptr, atype, self.ld,
                          zero.ctypes.data, scores.data.ptr, _CUDA_R_32F, high,
                          cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)  # fmt: skip
            self._mark("gemm")
            used = cublas.getStream(handle)
            if used != self.stream.ptr:
                if not self.gemm_stream_note:
                    self.gemm_stream_note = f"cuBLAS ran on stream {used:#x}, not {self.stream.ptr:#x}"
                    log.info("%s: ordering the GEMM path by device synchronization", self.gemm_stream_note)
                cp.cuda.runtime.deviceSynchronize()
            threshold = threshold and USE_THRESHOLD_TOPK and self._threshold_topk(scores, n, k, high)
            if not threshold:
                self._topk_scores(scores, n, k, high)
                self._mark("fallback top-k")
            del data

        def done() -> None:  # keeps ``scores`` alive until the kernels reading it are done
            with self.device, self.stream:
                self.stream.synchronize()
                self._mark("select synced" if threshold else "end")
                if threshold and self._overflow[0]:
                    self.threshold_overflows += 1
                    self._topk_scores(scores, n, k, high)
                    self.stream.synchronize()
                    self._mark("end")

        return done

    def _mark(self, stage: str) -> None:
        """Record ``stage`` on the stream and the host clock when tracing (see ``trace``)."""
        self._mark_on(stage, self.stream)

    def _mark_on(self, stage: str, stream: Any) -> None:
        if self.trace is not None:
            ev = self.cp.cuda.Event()
            ev.record(stream)
            self.trace.append((stage, ev, time.perf_counter_ns()))

    def _threshold_topk(self, scores: Any, n: int, k: int, high: int) -> bool:
        """Launch the top-k of each row of ``scores`` by tau_scores + filter_scores +
        select_cands (see kernels/recall.cu). Returns False, having launched nothing, when k
        and the row count need a sample too large for shared memory; when it returns True,
        ``self._overflow[0]`` says after the stream's work whether a candidate list overflowed
        (ties, adversarial data) and nothing usable was written: then topk_scores must run."""
        sample = self._tau_sample(k, high)
        if sample is None:
            return False
        flag = self._overflow
        flag[0] = 0
        tau = kernels.get_kernel("tau_scores", self.metric)
        filt = kernels.get_kernel("filter_scores", self.metric)
        sel = kernels.get_kernel("select_cands", self.metric)
        sel_smem = (CAND_CAP + SELECT_GATHER) * 8
        for kern, smem in ((tau, sample * 8), (sel, sel_smem)):
            if smem > max(48 * 1024, kern.max_dynamic_shared_size_bytes):
                kern.max_dynamic_shared_size_bytes = smem
        tau((n,), (kernels.BLOCK,), (scores, np.int32(high), self.ns, self.sqnorm, self.params,
                                     np.int32(sample), self.tau, np.int32(0)), shared_mem=sample * 8)  # fmt: skip
        self._mark("tau")
        # all queries together fill the device about 8 times over (each block one to a few
        # rounds of MERGE_UNROLL x BLOCK scores): with 2x and >= 64k scores per block the pass
        # over 24 x 1M scores took 131 us, far from the bandwidth's ~25 us
        gx = max(1, min(-(-high // (MERGE_UNROLL * kernels.BLOCK)), max(1, 8 * self.max_grid // n)))
        filt((gx, n), (kernels.BLOCK,), (scores, np.int32(high), self.ns, self.sqnorm, self.params,
                                         self.tau, self.cand_k, self.cand_v, self.cand_count,
                                         np.int32(CAND_CAP)))  # fmt: skip
        self._mark("filter")
        sel((n,), (kernels.BLOCK,), (self.cand_k, self.cand_v, self.cand_count, np.int32(CAND_CAP),
                                     self.params, np.uint64(self._overflow_addr)),
            shared_mem=sel_smem)  # fmt: skip
        self._mark("select")
        return True

    def _topk_scores(self, scores: Any, n: int, k: int, high: int) -> None:
        """Top-k of each row of ``scores`` with per-block candidate buffers (any k, any data)."""
        cp = self.cp
        kp = _pow2(k)
        buf = self._buf(kp)
        # blocks per query: each streams >= 16k scores, so after its first compaction its
        # threshold filters almost every later score (blocks of 4k scores each used to pay a
        # full 2048-entry sort: 3.4 ms for 64 queries at 1M rows); all queries together fill
        # the device about once
        grid = max(1, min(-(-high // 16384), max(1, self.max_grid // n), 16384 // kp))
        need = n * grid * k
        sk, sv = self.scratch_k, self.scratch_v
        if need > sk.size:
            sk, sv = cp.empty(need, cp.float32), cp.empty(need, cp.int32)
        kern = kernels.get_kernel("topk_scores", self.metric)
        smem = buf * 8
        if smem > max(48 * 1024, kern.max_dynamic_shared_size_bytes):
            kern.max_dynamic_shared_size_bytes = smem
        kern((grid, n), (kernels.BLOCK,),
             (scores, np.int32(high), self.ns, self.sqnorm, np.uint64(0), self.params,
              np.int32(buf), sk, sv, self.sync), shared_mem=smem)  # fmt: skip

    def _rescore(self, part: list[tuple[SlotSpec, int]], k: int, kc: int) -> None:
        """int8: exact scores of the kc candidates from the float16 host copy; best k first."""
        assert self.exact is not None
        for j, (s, qi) in enumerate(part):
            cand = self.cand_rows[j, :kc]
            cand = cand[cand >= 0]
            q = s.queries[qi].astype(np.float32)
            if self.metric == Metric.COSINE:
                q = normalize_rows(q[None, :])[0]
            x = self.exact[cand, : self.dim].astype(np.float32)
            sc = x @ q
            if self.metric == Metric.L2:
                sc = -np.sqrt(np.maximum((q @ q) - 2 * sc + np.einsum("ij,ij->i", x, x), 0))
            m = min(k, len(cand))
            idx, vals = topk_rows(sc[None, :], m)
            s.rows[qi, :m] = cand[idx[0]]
            s.scores[qi, :m] = vals[0]

    def _inject_fault(self) -> None:
        with self.device, self.stream:
            kernels.get_kernel("fault_kernel")((1,), (32,), (np.uint64(8),))
        self._check(self.stream.synchronize)

    def search(
        self,
        queries: np.ndarray,
        k: int,
        high: int,
        ns: int,
        candidates: np.ndarray | None,
        dense: bool,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Host-array search (used without a registered segment, e.g. by tests and benches):
        the same kernels, with queries and results in registered host buffers."""
        nq = len(queries)
        kk = k if self.exact is None else min(self.rescore_factor * k, max(k, high))
        nbytes = 4 * (nq * (self.dim + 2 * kk) + 64)
        mm = mmap.mmap(-1, -(-nbytes // 4096) * 4096)  # page-aligned, registered for this call
        buf = np.frombuffer(mm, np.float32)
        qv = buf[: nq * self.dim].reshape(nq, self.dim)
        qv[:] = queries
        rv = buf[nq * self.dim : nq * (self.dim + kk)].view(np.int32).reshape(nq, kk)
        sv = buf[nq * (self.dim + kk) : nq * (self.dim + 2 * kk)].reshape(nq, kk)
        rv.fill(0x7F7F7F7F)  # poison: an element the kernels fail to write cannot pass for a result
        sv.fill(np.nan)
        addr = buf.ctypes.data
        self._check(lambda: self.cp.cuda.runtime.hostRegister(addr, len(mm), 3))
        try:
            spec = SlotSpec(qv, rv, sv, qv.ctypes.data, rv.ctypes.data, sv.ctypes.data)
            saved, self.seg_addr = self.seg_addr, self.seg_addr or addr
            try:
                self.search_slots([spec], k, high, ns, candidates, dense)
            finally:
                self.seg_addr = saved
            return rv[:, :k].copy(), sv[:, :k].copy()
        finally:
            self.cp.cuda.runtime.hostUnregister(addr)  # the map itself goes with its last view

    def close(self) -> None:
        """Unregister every host buffer (before it is unmapped: an address reused by a later
        mapping must not still be registered)."""
        if getattr(self, "_closed", True):
            return
        self.detach_segment()
        self._closed = True
        self._mask_kept = None
        self._masks_kept.clear()
        car, self._car = self._car, None
        self._direct = None  # (its view of the slots' words: before the slots' map is closed)
        if car is not None and not (car.running and self._car_fault):
            with contextlib.suppress(Exception):
                car.close()
            if not car.running:
                with contextlib.suppress(Exception):
                    car.slots.close()
        # (a kernel that would not stop still reads its memory: left registered, the exit frees it)
        self.carousel_running = False
        if self.exact is not None:
            self._drop_exact()
        for addr in (self.desc_addr, self.cand_addr, self._bell_addr, self._arena_table[0]):
            if not addr:
                continue
            with contextlib.suppress(Exception):
                self.cp.cuda.runtime.hostUnregister(addr)
        self.graphs.clear()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
