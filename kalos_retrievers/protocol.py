"""Shared-memory protocol v1: layout, encoding and validation. Pure: no I/O, no shared memory.

Everything that crosses the process boundary is defined here, once, and both sides (the client
and the sidecar) import it. docs/protocol.md describes the same bytes for humans; a unit test
checks that the two agree.

The segment ``/kalos-NAME`` is::

    [ header: HEADER_SIZE bytes ][ slot 0 ][ slot 1 ] ... [ slot n_slots-1 ]

and each slot is::

    [ control words: CTL_SIZE ][ request payload ][ rows int32 ][ scores float32 ][ blob ]

The request payload holds float32 vectors first (query vectors, or the vectors of an upsert
chunk), then an args blob at ``align8(vec_len)``. The response puts the top-k row numbers and
scores at fixed offsets, so a GPU kernel can write them straight into the slot, and documents or
JSON into the blob. All integers are little-endian.

A bad request never raises out of :func:`validate_request`: it returns an error status and a
message that the sidecar writes back into the slot.
"""

from __future__ import annotations

import datetime
import itertools
import json
import json.encoder
import json.scanner
import math
import re
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Final, NamedTuple

import numpy as np

# --------------------------------------------------------------------------------------------
# Versions and names

MAGIC: Final = b"KALOSHM\x00"
VERSION_MAJOR: Final = 1
VERSION_MINOR: Final = 6

#: The longest args (:func:`encode_recall_args`: a namespace without a filter, a name of up to
#: 58 bytes of UTF-8) a DOORBELL recall may carry, once the header's ``doorbell_spaces`` is
#: nonzero (v1.5) and its ``doorbell_args`` is 0: the resident kernel compares that many bytes
#: with the namespaces it serves.
DOORBELL_ARGS_MAX: Final = 64
#: The longest args a v1.6 resident kernel compares (the header's ``doorbell_args`` where it
#: serves filters): a namespace, a filter or both, in 128 bytes (``{"user_id":"u-1234"}`` in a
#: namespace ``memories``: 36 bytes).
DOORBELL_SCOPE_ARGS_MAX: Final = 128


def ringable_args(args_len: int, name_len: int, args_max: int = 0) -> bool:
    """Whether a recall's args of ``args_len`` bytes, whose first two bytes give ``name_len``,
    may go to the resident kernel as a DOORBELL recall. ``args_max``: the header's
    ``doorbell_args`` (v1.6): nonzero, any args up to that many bytes (a namespace, a filter
    or both: the kernel compares them with the scopes it serves and hands back others); 0,
    the v1.5 rule, a namespace and no filter within :data:`DOORBELL_ARGS_MAX` bytes.
    (:func:`encode_recall_args` writes a u16 name length, the name, a u32 filter length and
    the filter: without a filter the args are the name's length plus 6 bytes.)"""
    if args_max:
        return 6 < args_len <= args_max
    return 6 < args_len <= DOORBELL_ARGS_MAX and args_len == name_len + 6

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def check_name(name: str) -> str:
    """Validate a sidecar name (the part after ``/kalos-``) and return it.

    Raises:
        ValueError: the name is empty, too long, or has characters other than letters, digits,
            ``_``, ``.`` and ``-``.
    """
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"name={name!r} is not a valid sidecar name: use 1-64 letters, digits, '_', '.' "
            "or '-', starting with a letter or digit"
        )
    return name


def segment_name(name: str) -> str:
    """POSIX shared-memory name of the segment (``/dev/shm/kalos-NAME`` on Linux)."""
    return f"/kalos-{check_name(name)}"


def doorbell_name(name: str) -> str:
    """Semaphore the clients post after publishing a request; the dispatcher waits on it."""
    return f"/kalos-{check_name(name)}-bell"


def carousel_segment_name(name: str) -> str:
    """POSIX shared-memory name of a GPU sidecar's carousel slots (v1.4, see :class:`CarouselLayout`)."""
    return f"/kalos-{check_name(name)}-car"


def response_sem_name(name: str, slot: int) -> str:
    """Semaphore the sidecar posts after publishing slot ``slot``'s response."""
    return f"/kalos-{check_name(name)}-r{slot}"


# --------------------------------------------------------------------------------------------
# Enumerations


class SidecarState:
    INITIALIZING: Final = 0
    READY: Final = 1
    STOPPING: Final = 2


class SlotState:
    """Values of a slot's state word. Only the owner writes FREE->CLAIMED->REQUEST; only the
    sidecar writes BUSY->RESPONSE/ERROR; the owner sets CLAIMED again after reading."""

    FREE: Final = 0
    CLAIMED: Final = 1
    REQUEST: Final = 2
    BUSY: Final = 3
    RESPONSE: Final = 4
    ERROR: Final = 5
    DOORBELL: Final = 6  # a batch-1 recall for the GPU's resident kernel (see docs/protocol.md)


class Op:
    PING: Final = 1
    RECALL: Final = 2
    UPSERT: Final = 3
    GET: Final = 4
    DELETE: Final = 5
    COUNT: Final = 6
    STATS: Final = 7
    CONTINUE: Final = 8
    SCAN: Final = 9
    NAMESPACES: Final = 10


OP_NAMES: Final = {v: k.lower() for k, v in vars(Op).items() if k.isupper()}


class Flag:
    """Request flags (bit set)."""

    WITH_VECTORS: Final = 1  # RECALL/GET/SCAN: append the stored vectors (float32) to the blob
    NO_DOCS: Final = 2  # RECALL: rows and scores only (no documents in the blob)
    ARENA_DOCS: Final = 4  # RECALL: each hit's row generation, not its document (see arena.py)
    # RECALL, with ARENA_DOCS (v1.3): the arena's version and each hit's whole arena entry
    # (offset, length, generation) instead of its generation: the client copies the record
    # without reading the row table (see arena.py)
    ARENA_ENTRIES: Final = 8


KNOWN_FLAGS: Final = Flag.WITH_VECTORS | Flag.NO_DOCS | Flag.ARENA_DOCS | Flag.ARENA_ENTRIES


class RespFlag:
    MORE: Final = 1  # the blob continues: send Op.CONTINUE for the next chunk
    HAS_VECTORS: Final = 2  # the blob (all chunks joined) ends with float32 vectors
    ARENA_DOCS: Final = 4  # the blob is one uint32 generation per hit; documents are in the arena
    ARENA_ENTRIES: Final = 8  # with ARENA_DOCS: the blob is u64 arena version, then one entry per hit


class Status:
    OK: Final = 0
    BAD_REQUEST: Final = 1
    BAD_OP: Final = 2
    DIMENSION: Final = 3
    TOO_LARGE: Final = 4
    DEADLINE: Final = 5
    CAPACITY: Final = 6
    STORE: Final = 7
    INTERNAL: Final = 8
    STOPPING: Final = 9


STATUS_NAMES: Final = {v: k.lower() for k, v in vars(Status).items() if k.isupper()}


class Metric:
    COSINE: Final = 0
    IP: Final = 1
    L2: Final = 2


METRICS: Final = {"cosine": Metric.COSINE, "ip": Metric.IP, "l2": Metric.L2}
METRIC_NAMES: Final = {v: k for k, v in METRICS.items()}

DTYPES: Final = {"float32": 0, "float16": 1, "int8": 2}
DTYPE_NAMES: Final = {v: k for k, v in DTYPES.items()}

# --------------------------------------------------------------------------------------------
# Header

HEADER_SIZE: Final = 4096
_HEADER_FIELDS: Final = (
    ("magic", "8s"),
    ("version_major", "H"),
    ("version_minor", "H"),
    ("header_size", "I"),
    ("state", "I"),
    ("n_slots", "I"),
    ("dim", "I"),
    ("dtype", "I"),
    ("metric", "I"),
    ("max_k", "I"),
    ("max_queries", "I"),
    ("max_results", "I"),
    ("slot_size", "Q"),
    ("payload_size", "Q"),
    ("blob_size", "Q"),
    ("capacity", "Q"),
    ("sidecar_pid", "Q"),
    ("boot_epoch", "Q"),
    ("heartbeat_ns", "Q"),
    ("row_count", "Q"),
    ("sidecar_uid", "Q"),
    ("name", "64s"),
    ("backend", "64s"),
    ("arena_version", "Q"),
    ("doorbell_k", "I"),
    ("doorbell_cap", "I"),
    ("carousel_epoch", "Q"),
    ("carousel_slots", "I"),
    ("doorbell_spaces", "I"),
    ("doorbell_args", "I"),
)
HEADER_STRUCT: Final = struct.Struct("<" + "".join(f for _, f in _HEADER_FIELDS))


def _offsets(fields: Sequence[tuple[str, str]]) -> dict[str, int]:
    out, off = {}, 0
    for name, fmt in fields:
        out[name] = off
        off += struct.calcsize("<" + fmt)
    return out


#: byte offset of each header field (the sidecar updates a few in place: state, heartbeat...)
HEADER_OFFSETS: Final = _offsets(_HEADER_FIELDS)
_FIELD_INDEX: Final = {name: i for i, (name, _) in enumerate(_HEADER_FIELDS)}
VERSION_OFFSET: Final = HEADER_OFFSETS["version_major"]


@dataclass(frozen=True)
class Layout:
    """Geometry of a segment: everything needed to find any byte of any slot."""

    n_slots: int
    dim: int
    max_k: int = 1024
    max_results: int = 8192
    payload_size: int = 1 << 20
    blob_size: int = 1 << 20

    def __post_init__(self) -> None:
        checks = (
            (1 <= self.n_slots <= 4096, f"slots={self.n_slots} must be in [1, 4096]"),
            (1 <= self.dim <= 65536, f"dim={self.dim} must be in [1, 65536]"),
            (1 <= self.max_k <= self.max_results, f"max_k={self.max_k} must be in [1, max_results={self.max_results}]"),
            (self.max_results <= 1 << 20, f"max_results={self.max_results} must be <= 1048576"),
            (
                self.payload_size % 128 == 0 and self.payload_size >= 4 * self.dim + 128,
                f"payload_size={self.payload_size} must be a multiple of 128 holding one vector",
            ),
            (self.blob_size % 128 == 0 and self.blob_size >= 4096, "blob_size must be >= 4096"),
        )
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)

    # offsets inside a slot (cached: the sidecar reads them for every request it answers) --
    @cached_property
    def payload_offset(self) -> int:
        return CTL_SIZE

    @cached_property
    def rows_offset(self) -> int:
        return CTL_SIZE + self.payload_size

    @cached_property
    def scores_offset(self) -> int:
        return self.rows_offset + 4 * _align(self.max_results, 32)

    @cached_property
    def blob_offset(self) -> int:
        return self.scores_offset + 4 * _align(self.max_results, 32)

    @cached_property
    def slot_size(self) -> int:
        return _align(self.blob_offset + self.blob_size, 4096)

    @cached_property
    def segment_size(self) -> int:
        return HEADER_SIZE + self.n_slots * self.slot_size

    @cached_property
    def max_queries(self) -> int:
        """Most query vectors one RECALL request carries (more are split by the client)."""
        return max(1, min(self.max_results, (self.payload_size - 4096) // (4 * self.dim)))

    def slot_offset(self, slot: int) -> int:
        return HEADER_SIZE + slot * self.slot_size


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def align8(n: int) -> int:
    return (n + 7) & ~7


@dataclass(frozen=True)
class Header:
    """Decoded segment header. ``layout`` rebuilds the slot geometry."""

    magic: bytes
    version_major: int
    version_minor: int
    header_size: int
    state: int
    n_slots: int
    dim: int
    dtype: int
    metric: int
    max_k: int
    max_queries: int
    max_results: int
    slot_size: int
    payload_size: int
    blob_size: int
    capacity: int
    sidecar_pid: int
    boot_epoch: int
    heartbeat_ns: int
    row_count: int
    sidecar_uid: int
    name: str
    backend: str
    arena_version: int = 0
    doorbell_k: int = 0
    doorbell_cap: int = 0
    carousel_epoch: int = 0
    carousel_slots: int = 0
    doorbell_spaces: int = 0
    doorbell_args: int = 0

    @property
    def layout(self) -> Layout:
        return Layout(
            n_slots=self.n_slots,
            dim=self.dim,
            max_k=self.max_k,
            max_results=self.max_results,
            payload_size=self.payload_size,
            blob_size=self.blob_size,
        )

    @property
    def metric_name(self) -> str:
        return METRIC_NAMES.get(self.metric, f"unknown({self.metric})")

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES.get(self.dtype, f"unknown({self.dtype})")


def encode_header(
    layout: Layout,
    *,
    metric: int,
    dtype: int,
    pid: int,
    uid: int,
    boot_epoch: int,
    name: str,
    backend: str,
    state: int = SidecarState.INITIALIZING,
    version_major: int = VERSION_MAJOR,
    capacity: int = 0,
    row_count: int = 0,
    heartbeat_ns: int = 0,
    arena_version: int = 0,
) -> bytes:
    """Header bytes. The sidecar writes them with version 0, then sets the version last."""
    return HEADER_STRUCT.pack(
        MAGIC,
        version_major,
        VERSION_MINOR,
        HEADER_SIZE,
        state,
        layout.n_slots,
        layout.dim,
        dtype,
        metric,
        layout.max_k,
        layout.max_queries,
        layout.max_results,
        layout.slot_size,
        layout.payload_size,
        layout.blob_size,
        capacity,
        pid,
        boot_epoch,
        heartbeat_ns,
        row_count,
        uid,
        name.encode()[:64],
        backend.encode()[:64],
        arena_version,
        0,
        0,
        0,
        0,
        0,
        0,
    )


class HeaderError(Exception):
    """Why a header cannot be used; ``kind`` is one of the class constants (pure; the client
    maps each kind to its public error)."""

    SHORT = "short"
    MAGIC = "magic"
    INITIALIZING = "initializing"
    VERSION = "version"
    CORRUPT = "corrupt"

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def foreign_segment(buf: bytes | memoryview) -> bool:
    """Whether a segment's first bytes say another program wrote it: neither Kalos's magic
    nor zeros (what a sidecar that died before writing its header leaves). Whoever finds a
    segment under a Kalos name with no sidecar's lock held reads this before calling it
    stale: a foreign segment is never removed, and is reported as not Kalos's."""
    head = bytes(buf[:8])
    return head != MAGIC and any(head)


def starting_pid(buf: bytes | memoryview) -> int | None:
    """The pid in a header the sidecar has written but not yet opened (version 0: it is still
    loading its rows), else None. For ``kalos-sidecar stop``, which must reach a sidecar that
    clients cannot use yet; whoever reads it checks that the sidecar's lock is held."""
    if len(buf) < HEADER_STRUCT.size or bytes(buf[:8]) != MAGIC:
        return None
    pid: int = struct.unpack_from("<Q", buf, HEADER_OFFSETS["sidecar_pid"])[0]
    return pid if 0 < pid < 1 << 31 else None


def decode_header(buf: bytes | memoryview, segment_size: int | None = None) -> Header:
    """Decode and check a header.

    Raises:
        HeaderError: too short, wrong magic, still initializing (version 0), another protocol
            major version, or a geometry that does not match ``segment_size``.
    """
    if len(buf) < HEADER_STRUCT.size or (segment_size is not None and segment_size < HEADER_SIZE):
        raise HeaderError(HeaderError.SHORT, f"segment is {len(buf)} bytes, shorter than a header")
    vals = list(HEADER_STRUCT.unpack_from(buf, 0))
    if vals[0] == b"\x00" * 8:  # created, header not written yet
        raise HeaderError(HeaderError.INITIALIZING, "the sidecar is still initializing")
    if vals[0] != MAGIC:
        raise HeaderError(HeaderError.MAGIC, f"bad magic {vals[0]!r}: not a Kalos segment")
    if vals[1] == 0:
        raise HeaderError(HeaderError.INITIALIZING, "the sidecar is still initializing")
    if vals[1] != VERSION_MAJOR:
        raise HeaderError(
            HeaderError.VERSION,
            f"segment speaks protocol v{vals[1]}.{vals[2]}, this client speaks "
            f"v{VERSION_MAJOR}.{VERSION_MINOR}",
        )
    for f in ("name", "backend"):
        vals[_FIELD_INDEX[f]] = vals[_FIELD_INDEX[f]].rstrip(b"\x00").decode(errors="replace")
    header = Header(*vals)
    try:
        layout = header.layout
    except ValueError as e:
        raise HeaderError(HeaderError.CORRUPT, f"header geometry is invalid: {e}") from None
    if (
        header.header_size != HEADER_SIZE
        or layout.slot_size != header.slot_size
        or layout.max_queries != header.max_queries
        or (segment_size is not None and segment_size < layout.segment_size)
    ):
        raise HeaderError(
            HeaderError.CORRUPT,
            f"header geometry does not match: slot_size {header.slot_size} vs {layout.slot_size}, "
            f"segment {segment_size} bytes vs {layout.segment_size} needed",
        )
    return header


# --------------------------------------------------------------------------------------------
# The carousel's slots (v1.4)
#
# A GPU sidecar running the carousel (sidecar/carousel.py, KALOS_CAROUSEL=direct) lets the
# clients write batch-1 recalls into the kernel's own slots, in the segment
# carousel_segment_name(NAME): no sidecar Python between a client and the kernel. Slot i there
# belongs to the client holding protocol slot i, for i < the header's carousel_slots. While the
# header's carousel_epoch is odd the kernel takes requests; the sidecar makes it even before it
# stops the kernel, and then turns every request the kernel did not answer back to IDLE (the
# client asks again the usual way). docs/protocol.md says the rest.

CAR_IDLE: Final = 0
CAR_REQUEST: Final = 1  # written by the client, after everything else
CAR_TAKEN: Final = 2  # the kernel has the request
CAR_DONE: Final = 3  # answered: results and words are in
CAR_ERROR: Final = 4  # refused (a query the kernel cannot score, a k outside [1, CAR_KMAX])
CAR_KMAX: Final = 32  # the largest k the kernel answers
CAR_MAX_SLOTS: Final = 64  # slots in the segment (the kernel polls up to 64)
CAR_HEAD: Final = 32  # a slot's control words (u32) before its query
# a slot's u32 words: [0] state [1] k [2] namespace (the sidecar's) [3] seq; the answer: [4] results
# [5] the seq it answers [6] the kernel's time aboard (ns, for diagnostics); [7] the rows of the
# namespace (the sidecar's, for direct slots: an answer has min(k, this) results; the kernel does
# not read it)
W_STATE, W_K, W_NS, W_SEQ, W_RESULTS, W_RESP_SEQ, W_NS_ABOARD, W_ELIGIBLE = range(8)


# The queries the kernel scores as the sidecar would, by their largest |element|: for cosine its
# float32 sum of squares (at most 65,536 elements) must be a normal number (a zero or subnormal
# sum leaves the query unnormalized, every half zero: a wrong answer, not a refusal; an infinite
# one is refused); for inner product and L2 every element must fit float16 (beyond, refused).
CAR_COS_MIN: Final = 1e-15
CAR_COS_MAX: Final = 5e16
CAR_F16_MAX: Final = 65504.0


def car_bounds(metric: int) -> tuple[float, float]:
    """The range ``(lo, hi)`` a finite query's largest |element| must lie in for the carousel
    to score it as the sidecar would (``metric``: :class:`Metric`; :func:`car_takes`)."""
    return (CAR_COS_MIN, CAR_COS_MAX) if metric == Metric.COSINE else (0.0, CAR_F16_MAX)


def car_takes(metric: int, amax: float) -> bool:
    """Whether a finite query whose largest |element| is ``amax`` may go to the carousel
    (``metric``: :class:`Metric`); the others are asked the usual way."""
    lo, hi = car_bounds(metric)
    return lo <= amax <= hi


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class CarouselLayout(NamedTuple):
    """Where a carousel slot's parts are, for ``dim``-float queries (byte offsets in a slot):
    the control words, the query (float32) at CAR_HEAD, CAR_KMAX rows (int32) at ``rows_off``,
    CAR_KMAX scores (float32) at ``scores_off``; slots ``slot_bytes`` apart (a multiple of 128)."""

    dim: int
    rows_off: int
    scores_off: int
    slot_bytes: int

    @classmethod
    def of(cls, dim: int) -> CarouselLayout:
        if dim < 1:
            raise ValueError(f"dim must be positive, not {dim}")
        rows_off = CAR_HEAD + _round_up(4 * dim, 16)
        scores_off = rows_off + 4 * CAR_KMAX
        return cls(dim, rows_off, scores_off, _round_up(scores_off + 4 * CAR_KMAX, 128))

    def segment_size(self, n: int = CAR_MAX_SLOTS) -> int:
        """Bytes of ``n`` slots, rounded up to whole 4 KiB pages."""
        return _round_up(n * self.slot_bytes, 4096)


# --------------------------------------------------------------------------------------------
# Slot control words

CTL_SIZE: Final = 128
_CTL_FIELDS: Final = (
    ("state", "I"),
    ("owner_pid", "I"),
    # request: written by the owner before it sets REQUEST
    ("seq", "Q"),
    ("op", "I"),
    ("flags", "I"),
    ("top_k", "I"),
    ("n_items", "I"),
    ("vec_len", "Q"),
    ("args_len", "Q"),
    ("deadline_ns", "Q"),
    # response: written by the sidecar before it sets RESPONSE/ERROR
    ("resp_seq", "Q"),
    ("status", "I"),
    ("n_results", "I"),
    ("resp_len", "Q"),
    ("resp_flags", "Q"),
    # bookkeeping
    ("claim_ns", "Q"),
)
CTL_OFFSETS: Final = _offsets(_CTL_FIELDS)
#: the request words, from ``seq`` to ``deadline_ns`` (the sidecar copies these once)
REQUEST_STRUCT: Final = struct.Struct("<QIIIIQQQ")
REQUEST_OFFSET: Final = CTL_OFFSETS["seq"]
#: the response words, from ``resp_seq`` to ``resp_flags``
RESPONSE_STRUCT: Final = struct.Struct("<QIIQQ")
RESPONSE_OFFSET: Final = CTL_OFFSETS["resp_seq"]
assert REQUEST_OFFSET + REQUEST_STRUCT.size == RESPONSE_OFFSET
assert RESPONSE_OFFSET + RESPONSE_STRUCT.size == CTL_OFFSETS["claim_ns"]


class Request(NamedTuple):
    """A request's control words, as copied once out of the slot."""

    seq: int
    op: int
    flags: int
    top_k: int
    n_items: int
    vec_len: int
    args_len: int
    deadline_ns: int

    @classmethod
    def unpack(cls, buf: bytes | memoryview, offset: int = REQUEST_OFFSET) -> Request:
        return cls._make(REQUEST_STRUCT.unpack_from(buf, offset))

    def pack(self) -> bytes:
        return REQUEST_STRUCT.pack(*self)


class Response(NamedTuple):
    seq: int
    status: int
    n_results: int
    resp_len: int
    resp_flags: int

    @classmethod
    def unpack(cls, buf: bytes | memoryview, offset: int = RESPONSE_OFFSET) -> Response:
        return cls._make(RESPONSE_STRUCT.unpack_from(buf, offset))


class Invalid(Exception):
    """A request the sidecar must refuse: ``status`` goes back to the client with the message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


_NEEDS_ARGS: Final = {Op.UPSERT, Op.GET, Op.DELETE}
_ALL_OPS: Final = frozenset(OP_NAMES)


def validate_request(req: Request, layout: Layout) -> None:
    """Check a copied request against the segment's layout. Pure and total: any 64-bit values
    either pass or raise :class:`Invalid`; a request that passes never makes the sidecar read
    or write outside the slot.

    Raises:
        Invalid: with the status to answer and a message saying what is wrong.
    """
    if req.op not in _ALL_OPS:
        raise Invalid(Status.BAD_OP, f"unknown op {req.op}")
    if req.flags & ~KNOWN_FLAGS:
        raise Invalid(Status.BAD_REQUEST, f"unknown flags {req.flags:#x}")
    if req.flags & Flag.ARENA_ENTRIES and not req.flags & Flag.ARENA_DOCS:
        raise Invalid(Status.BAD_REQUEST, "flag ARENA_ENTRIES without ARENA_DOCS")
    if req.vec_len > layout.payload_size or req.args_len > layout.payload_size:
        raise Invalid(Status.TOO_LARGE, "payload lengths exceed the slot")
    if align8(req.vec_len) + req.args_len > layout.payload_size:
        raise Invalid(Status.TOO_LARGE, "vectors plus args exceed the slot payload")
    if req.vec_len % 4:
        raise Invalid(Status.BAD_REQUEST, "vector bytes are not a whole number of float32")
    row_bytes = 4 * layout.dim
    if req.op == Op.RECALL:
        if not 1 <= req.top_k <= layout.max_k:
            raise Invalid(Status.BAD_REQUEST, f"k={req.top_k} must be in [1, {layout.max_k}]")
        if not 1 <= req.n_items <= layout.max_queries:
            raise Invalid(
                Status.BAD_REQUEST,
                f"{req.n_items} queries in one request; must be in [1, {layout.max_queries}]",
            )
        if req.n_items * req.top_k > layout.max_results:
            raise Invalid(
                Status.TOO_LARGE,
                f"{req.n_items} queries x k={req.top_k} exceeds {layout.max_results} results",
            )
        if req.vec_len != req.n_items * row_bytes:
            raise Invalid(
                Status.DIMENSION,
                f"query bytes {req.vec_len} != {req.n_items} x dim {layout.dim} x 4",
            )
    elif req.op == Op.UPSERT:
        if req.n_items < 1 or req.vec_len != req.n_items * row_bytes:
            raise Invalid(
                Status.DIMENSION,
                f"upsert vector bytes {req.vec_len} != {req.n_items} x dim {layout.dim} x 4",
            )
    elif req.vec_len:
        raise Invalid(Status.BAD_REQUEST, f"op {OP_NAMES[req.op]} carries no vectors")
    if req.op in _NEEDS_ARGS and req.args_len == 0:
        raise Invalid(Status.BAD_REQUEST, f"op {OP_NAMES[req.op]} needs arguments")


# --------------------------------------------------------------------------------------------
# Args blobs

_NS_LEN: Final = struct.Struct("<H")
_FILTER_LEN: Final = struct.Struct("<I")


def encode_recall_args(namespace: str, filter_json: bytes | None) -> bytes:
    """Args of a RECALL: the namespace and an optional filter (JSON). Empty for the common case
    (default namespace, no filter), so the hot path decodes nothing."""
    ns = namespace.encode()
    if not ns and not filter_json:
        return b""
    f = filter_json or b""
    return _NS_LEN.pack(len(ns)) + ns + _FILTER_LEN.pack(len(f)) + f


def decode_recall_args(buf: bytes) -> tuple[str, Any]:
    """Inverse of :func:`encode_recall_args`. Returns (namespace, filter or None).

    Raises:
        Invalid: truncated, trailing bytes, bad UTF-8 or bad JSON.
    """
    if not buf:
        return "", None
    try:
        (n,) = _NS_LEN.unpack_from(buf, 0)
        ns = buf[2 : 2 + n].decode()
        (fl,) = _FILTER_LEN.unpack_from(buf, 2 + n)
        start = 6 + n
        if start + fl != len(buf) or len(ns.encode()) != n:
            raise Invalid(Status.BAD_REQUEST, "recall args have the wrong length")
        flt = json.loads(buf[start:]) if fl else None
    except Invalid:
        raise
    except (struct.error, UnicodeDecodeError, ValueError, RecursionError) as e:
        # RecursionError: a deeply nested filter (json.loads gives up); a refusal, not a crash
        raise Invalid(Status.BAD_REQUEST, f"recall args do not decode: {e}") from None
    return ns, flt


#: how deep a memory's metadata may nest (dicts and lists): deeper, reading it back ran out
#: of Python's recursion limit in an application's deeper stacks (980 levels stored fine and
#: then broke every recall that returned the row)
MAX_METADATA_DEPTH: Final = 64


def nests_deeper(value: Any, limit: int = MAX_METADATA_DEPTH) -> bool:
    """Whether ``value`` holds dicts/lists nested more than ``limit`` levels (the value itself
    is level 1). Iterative: any depth is measured without recursion."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict | list | tuple):
            if depth > limit:
                return True
            stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return False


def encode_json(obj: Any) -> bytes:
    """Strict JSON (no NaN/Infinity), compact, UTF-8: ``json.dumps(obj, separators=(",", ":"),
    allow_nan=False, ensure_ascii=False).encode()``, byte for byte and error for error.

    One encoder made once (``json.dumps`` with arguments makes a new one per call), and a
    string straight through the encoder's own string routine: a bulk upsert encodes two
    strings per row (0.8 -> 0.07 µs each on the development VM; a small dict 2.6 -> 1.8)."""
    if type(obj) is str:
        return _encode_str(obj).encode()
    return _ENCODER.encode(obj).encode()


_ENCODER: Final = json.JSONEncoder(separators=(",", ":"), allow_nan=False, ensure_ascii=False)
_encode_str: Final = json.encoder.encode_basestring  # what _ENCODER.encode does with a str


#: the types :func:`json_value` converts (isinstance's tuple)
JSON_CONVERTED: Final = (datetime.date, datetime.time, np.integer, np.floating, np.bool_)


def json_value(o: Any) -> Any:
    """What metadata (and a filter) stores for a value plain JSON has no form for, where one
    is plain: a ``datetime``, ``date`` or ``time`` is its ISO 8601 string, Python's
    ``isoformat()`` (LangChain's ``TimeWeightedVectorStoreRetriever`` puts datetimes in every
    document's metadata; strings of one offset sort in time order, as ``+00:00`` does but
    pydantic's ``Z`` for UTC does not beside fractions of a second), a numpy integer, float or
    bool the Python number (a pandas column's). Any other object is refused, as ``json``
    refuses it (``TypeError``)."""
    if isinstance(o, datetime.date | datetime.time):
        return o.isoformat()
    if isinstance(o, np.bool_):
        return bool(o)
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)  # (not .item(): a longdouble's is a longdouble again)
    raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")


#: ``encode_json``'s encoder, with :func:`json_value` for what JSON has no form for (metadata)
METADATA_ENCODER: Final = json.JSONEncoder(separators=(",", ":"), allow_nan=False, ensure_ascii=False,
                                           default=json_value)  # fmt: skip


#: The argument keys each JSON-args op accepts. A closed set: a misspelled key (say
#: "namepsace") is refused rather than silently ignored, which would write to the default
#: namespace.
ARG_KEYS: Final = {
    Op.UPSERT: frozenset({"namespace", "ids", "texts", "metadatas"}),
    Op.GET: frozenset({"namespace", "ids"}),
    Op.SCAN: frozenset({"namespace", "filter", "limit", "offset"}),
    Op.DELETE: frozenset({"namespace", "ids", "filter", "all"}),
    Op.COUNT: frozenset({"namespace", "filter"}),
    Op.NAMESPACES: frozenset({"prefix"}),  # (optional: no args lists every namespace)
}


def decode_json_args(buf: bytes, op: int | None = None) -> dict[str, Any]:
    """Args of the non-hot-path ops: one JSON object (with only ``op``'s keys, if given).

    Raises:
        Invalid: not UTF-8, not JSON, not an object, or a key the op does not take.
    """
    try:
        obj = json.loads(buf.decode(), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise Invalid(Status.BAD_REQUEST, f"args are not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise Invalid(Status.BAD_REQUEST, "args must be a JSON object")
    allowed = ARG_KEYS.get(op) if op is not None else None
    if allowed is not None:
        unknown = sorted(set(obj) - allowed)
        if unknown:
            raise Invalid(
                Status.BAD_REQUEST,
                f"{OP_NAMES[op]} does not take argument(s) {unknown}; it takes {sorted(allowed)}",
            )
    return obj


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


# --------------------------------------------------------------------------------------------
# Documents: pre-encoded once at upsert, copied verbatim into every response that returns them

DOC_HEADER: Final = struct.Struct("<ddIII")  # created_at, updated_at, id_len, text_len, meta_len
_DOC_TIMES: Final = struct.Struct("<dd")
_DOC_UNPACK: Final = DOC_HEADER.unpack_from
_DOC_SIZE: Final = DOC_HEADER.size


def encode_doc(id_: str, text: str, metadata_json: bytes, created_at: float, updated_at: float) -> bytes:
    i, t = id_.encode(), text.encode()
    return DOC_HEADER.pack(created_at, updated_at, len(i), len(t), len(metadata_json)) + i + t + metadata_json


@dataclass(frozen=True)
class Doc:
    id: str
    text: str
    metadata: dict[str, Any]
    created_at: float
    updated_at: float


# json.loads(bytes) first detects the encoding and strips whitespace in Python code: for the
# small metadata objects of a recall, that is most of its ~1.3-1.7 us. The C scanner under it
# parses our compact UTF-8 JSON (encode_json) in ~0.2-0.5 us; anything it does not take whole
# goes to json.loads, for the same result or the same error.
_scan_json: Final = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[attr-defined]


def _loads_object(raw: bytes) -> dict[str, Any]:
    if raw == b"{}":
        return {}
    try:
        s = raw.decode()
        obj, end = _scan_json(s, 0)
    except (StopIteration, ValueError):  # UnicodeDecodeError is a ValueError
        s, end = "", -1
    if end != len(s):
        obj = json.loads(raw)  # the bytes: its encoding detection and errors, exactly
    if not isinstance(obj, dict):
        raise ProtocolDecodeError("document metadata is not a JSON object")
    return obj


def decode_doc_fields(buf: bytes | memoryview) -> tuple[str, str, dict[str, Any]]:
    """``(id, text, metadata)`` of one document record: :func:`decode_doc` without the
    timestamps and without building a :class:`Doc` (what adapters need, per hit).

    Raises:
        ProtocolDecodeError: lengths that do not add up, bad UTF-8 or JSON.
    """
    try:
        _, _, il, tl, ml = _DOC_UNPACK(buf, 0)
        a = _DOC_SIZE + il
        b = a + tl
        if b + ml != len(buf):
            raise ProtocolDecodeError("document record lengths do not add up")
        raw = bytes(buf)
        meta = raw[b:]
        return raw[_DOC_SIZE:a].decode(), raw[a:b].decode(), {} if meta == b"{}" or not ml else _loads_object(meta)
    except (struct.error, UnicodeDecodeError, ValueError, RecursionError) as e:
        # (RecursionError: metadata nested deeper than json goes)
        raise ProtocolDecodeError(f"document record does not decode: {e}") from None


def decode_doc(buf: bytes | memoryview) -> Doc:
    """Decode one document record.

    Raises:
        ProtocolDecodeError: lengths that do not add up, bad UTF-8 or JSON.
    """
    id_, text, meta = decode_doc_fields(buf)
    created, updated = _DOC_TIMES.unpack_from(buf, 0)
    return Doc(id_, text, meta, created, updated)


def doc_times(buf: bytes | memoryview) -> tuple[float, float]:
    """``(created_at, updated_at)`` of a document record."""
    try:
        return _DOC_TIMES.unpack_from(buf, 0)  # type: ignore[return-value]
    except struct.error as e:
        raise ProtocolDecodeError(f"document record does not decode: {e}") from None


def doc_id(buf: bytes | memoryview) -> str:
    """Just the id of a document record (cheaper than :func:`decode_doc`)."""
    try:
        _, _, il, _, _ = DOC_HEADER.unpack_from(buf, 0)
        return bytes(buf[DOC_HEADER.size : DOC_HEADER.size + il]).decode()
    except (struct.error, UnicodeDecodeError) as e:
        raise ProtocolDecodeError(f"document id does not decode: {e}") from None


class ProtocolDecodeError(Exception):
    """A response blob does not decode (the client turns it into ``ProtocolError``)."""


_U32: Final = struct.Struct("<I")


def encode_docs_blob(docs: Sequence[bytes], vectors: np.ndarray | None = None) -> bytes:
    """``[u32 n][u32 offsets x (n+1)][docs...][pad to 4][float32 vectors n x dim]``."""
    n = len(docs)
    offsets = [0, *itertools.accumulate(map(len, docs))]
    parts = [struct.pack(f"<{n + 2}I", n, *offsets), *docs]
    if vectors is not None:
        size = 4 * (n + 2) + offsets[-1]
        parts.append(b"\x00" * (-size % 4))
        parts.append(np.ascontiguousarray(vectors, dtype="<f4").tobytes())
    return b"".join(parts)


class DocViews(Sequence[memoryview]):
    """Documents in a buffer as a sequence of memoryviews, cut on access: document ``j`` is
    ``mv[starts[j] : ends[j]]``.

    The buffer is a response's docs blob (:func:`decode_docs_blob`) or the sidecar's document
    arena (:meth:`kalos_retrievers.arena.ArenaView.docs`). A recall of 64 queries returns 640
    documents; cutting all of them up front took ~50 us on the development VM, and most callers
    read only some. Slicing gives another ``DocViews`` over the same buffer (a query's share
    of a batch)."""

    __slots__ = ("_ends", "_mv", "_start", "_starts", "_stop")

    def __init__(self, mv: memoryview, starts: Sequence[int], ends: Sequence[int], start: int = 0,
                 stop: int | None = None) -> None:  # fmt: skip
        self._mv, self._starts, self._ends = mv, starts, ends
        self._start = start
        self._stop = len(starts) if stop is None else stop

    def __len__(self) -> int:
        return self._stop - self._start

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            a, b, step = i.indices(len(self))
            if step != 1:
                return [self[j] for j in range(a, b, step)]
            return DocViews(self._mv, self._starts, self._ends, self._start + a, self._start + max(a, b))
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        j = self._start + i
        return self._mv[self._starts[j] : self._ends[j]]

    def part(self, a: int, n: int) -> DocViews:
        """Documents ``a`` to ``a + n`` (``0 <= a <= a + n <= len(self)``, unchecked): one
        query's share of a batch, without a slice object."""
        start = self._start + a
        return DocViews(self._mv, self._starts, self._ends, start, start + n)

    def split(self, n: int) -> list[DocViews]:
        """``n`` consecutive equal parts (one per query of a batch), without slice objects."""
        per = len(self) // n if n > 0 else -1
        if per * n != len(self) or n <= 0:
            raise ValueError(f"{len(self)} documents do not split into {n} equal parts")
        mv, s, e, a = self._mv, self._starts, self._ends, self._start
        return [DocViews(mv, s, e, a + per * i, a + per * (i + 1)) for i in range(n)]

    def __iter__(self) -> Iterator[memoryview]:
        mv, s, e = self._mv, self._starts, self._ends
        for j in range(self._start, self._stop):
            yield mv[s[j] : e[j]]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"DocViews(n={len(self)})"


def split_docs(docs: DocViews | list[bytes], n: int) -> list[DocViews] | list[list[bytes]]:
    """``docs`` in ``n`` consecutive equal parts (one per query of a batch)."""
    if isinstance(docs, DocViews):
        return docs.split(n)
    if n <= 0 or len(docs) % n:
        raise ValueError(f"{len(docs)} documents do not split into {n} equal parts")
    per = len(docs) // n
    return [docs[per * i : per * (i + 1)] for i in range(n)]


def decode_docs_blob(blob: bytes, dim: int, has_vectors: bool) -> tuple[DocViews, np.ndarray | None]:
    """Split a docs blob into per-document views (decoded later, lazily) and the vectors.

    Raises:
        ProtocolDecodeError: the blob's counts and offsets are inconsistent.
    """
    try:
        (n,) = _U32.unpack_from(blob, 0)
        base = 4 * (n + 2)
        if base > len(blob):
            raise ProtocolDecodeError("docs blob shorter than its offset table")
        offsets = struct.unpack_from(f"<{n + 1}I", blob, 4)
        end = base + offsets[-1]
        if end > len(blob) or offsets[0] != 0 or list(offsets) != sorted(offsets):
            raise ProtocolDecodeError("docs blob offsets are inconsistent")
        docs = DocViews(memoryview(blob)[base:], offsets[:-1], offsets[1:])
        vectors = None
        if has_vectors:
            vstart = end + (-end % 4)
            if len(blob) - vstart != 4 * n * dim:
                raise ProtocolDecodeError("docs blob vector section has the wrong size")
            vectors = np.frombuffer(blob, dtype="<f4", offset=vstart).reshape(n, dim)
        elif end != len(blob):
            raise ProtocolDecodeError("docs blob has trailing bytes")
        return docs, vectors
    except struct.error as e:
        raise ProtocolDecodeError(f"docs blob does not decode: {e}") from None


_F32_PACKERS: dict[int, struct.Struct] = {}


def _list_vector(values: list[Any], dim: int) -> np.ndarray | None:
    """One vector given as a list of ``dim`` numbers (what an ``Embeddings`` returns) as a
    (1, dim) float32 array, packed by ``struct``: ~3 us for 768 floats on the development VM,
    against ~9 us through numpy's conversion of a sequence. None when ``struct`` refuses an
    item (a string, a float32 overflow): the caller converts through numpy, whose conversion
    and messages are the reference."""
    packer = _F32_PACKERS.get(dim)
    if packer is None:
        packer = _F32_PACKERS[dim] = struct.Struct(f"={dim}f")  # native order: numpy's float32
    out = np.empty((1, dim), np.float32)
    try:
        packer.pack_into(out, 0, *values)
    except (struct.error, OverflowError, TypeError, ValueError):
        return None
    return out


def check_vectors(vectors: Any, dim: int, argument: str) -> np.ndarray:
    """Validate vectors given by a user: shape (n, dim) or (dim,), finite. (All-zero vectors
    pass here; upserts under cosine refuse them, see ``KalosClient.upsert``.)

    Returns a C-contiguous float32 array of shape (n, dim).

    Raises:
        ValueError: naming ``argument``, for a wrong shape or dimension, or NaN/inf.
    """
    # (the fast path only for a list of Python floats, as embedding models return: struct
    # would also take any object with __float__, such as a one-element tensor, that numpy's
    # conversion refuses or converts differently)
    fast = type(vectors) is list and len(vectors) == dim and type(vectors[0]) is float
    arr = _list_vector(vectors, dim) if fast else None
    if arr is None:
        try:
            arr = np.asarray(vectors, dtype=np.float32)
        except (TypeError, ValueError, OverflowError) as e:  # (an int beyond any float)
            raise ValueError(f"{argument} must be numeric vectors: {e}") from None
        if arr.ndim == 1:
            arr = arr[None, :]
        if arr.ndim != 2 or arr.shape[1] != dim:
            raise ValueError(
                f"{argument} has shape {tuple(np.shape(vectors))}; this sidecar stores dim={dim} "
                f"vectors, so expected ({dim},) or (n, {dim}). Use an embedding model with {dim} "
                "dimensions, or start another sidecar with --dim matching your model"
            )
        arr = np.ascontiguousarray(arr)
    if not np.isfinite(arr).all():
        bad = int(np.flatnonzero(~np.isfinite(arr).all(axis=1))[0])
        try:  # (finite as given, infinite as float32: say so, not "NaN or infinity")
            wide = np.asarray(vectors, dtype=np.float64).reshape(arr.shape)[bad]
        except (TypeError, ValueError, OverflowError):
            wide = None
        if wide is not None and np.isfinite(wide).all():
            raise ValueError(f"{argument}[{bad}] has a value beyond float32's range (+-3.4e38), "
                             "which vectors are stored as")  # fmt: skip
        raise ValueError(f"{argument}[{bad}] contains NaN or infinity")
    return arr


def is_finite_json_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
