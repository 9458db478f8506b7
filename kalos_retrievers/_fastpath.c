/* The batch-1 recall in C: the client library's hot path.
 *
 * recall1: to a GPU sidecar's resident kernel, below. request1 / answer1: a recall the sidecar
 * answers (no resident kernel takes it): request1 writes the same request words and query with
 * the state REQUEST; the client posts the sidecar's doorbell and waits in Python as for any
 * request (its spin, sleep and block, the deadline and the sidecar's death); answer1 then reads
 * the answer as recall1 does, or leaves it, untouched, to the Python path. car_request1 /
 * car_wait1 / car_answer1: a recall written into the carousel's own slots (protocol v1.4,
 * KALOS_CAROUSEL=direct), further below.
 *
 * `KalosClient.recall` of one query (the default namespace, no filter, documents from the
 * arena) writes the query and the request words into its slot, sets DOORBELL, spins on the
 * state word until the kernel's answer, copies the rows and scores, and copies each hit's
 * document out of the arena. In Python those steps cost 20-35 us on the H200 host around a
 * 60-230 us exchange (benchmarks/client_phases.py, session 18); here they are one call.
 *
 * Only the common case is done here, completely; everything else returns and the Python
 * path (kalos_retrievers/client.py) carries on from the wait with the request already
 * written, exactly as it would have after writing it itself: an answer not there within the
 * spin window, a request the kernel handed back (REQUEST), the kernel stopped (the header's
 * doorbell word 0), an error status, a sequence or length that does not check, a continued
 * answer. The documents are copied only when every entry checks (as ArenaView.entry_docs);
 * otherwise the answer comes back without them (None) and Python reads them its own way.
 *
 * Built against the stable ABI (Py_LIMITED_API, 3.11): one binary for every CPython >= 3.11.
 * Optional: without a compiler the package installs without it and uses the Python path.
 * x86-64 only in use (the client calls it only where the store ordering it relies on holds:
 * the query and request words written before the state word, the answer's words read after
 * its state word). The offsets below are protocol v1's control words (protocol.py CTL_OFFSETS;
 * tests/unit/test_fastpath.py checks them against the module's CTL_OFFSETS).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <pthread.h>

enum {
    OFF_STATE = 0, OFF_SEQ = 8, OFF_OP = 16, OFF_FLAGS = 20, OFF_TOP_K = 24, OFF_N_ITEMS = 28,
    OFF_VEC_LEN = 32, OFF_ARGS_LEN = 40, OFF_DEADLINE = 48, OFF_RESP_SEQ = 56, OFF_STATUS = 64,
    OFF_N_RESULTS = 68, OFF_RESP_LEN = 72, OFF_RESP_FLAGS = 80, CTL_SIZE = 128,
};
enum { ST_CLAIMED = 1, ST_REQUEST = 2, ST_RESPONSE = 4, ST_ERROR = 5, ST_DOORBELL = 6 };
enum { OP_RECALL = 2, RESP_MORE = 1, RESP_ARENA_DOCS = 4, RESP_ARENA_ENTRIES = 8 };
enum { CAR_REQUEST = 1, CAR_TAKEN = 2, CAR_DONE = 3, CAR_KMAX = 32 };  /* the carousel's (below) */
#define ENTRY_SIZE 16
#define CHECK_EVERY_NS 50000  /* the header's doorbell word is read this often while spinning */

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);  /* time.monotonic_ns()'s clock */
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline uint32_t ld32(const char* p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t ld64(const char* p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline void st32(char* p, uint32_t v) { memcpy(p, &v, 4); }
static inline void st64(char* p, uint64_t v) { memcpy(p, &v, 8); }

/* 1 when none of the n float32 values at p is a NaN or an infinity (exponent bits all ones),
   four at a time with GCC's vector extensions (SSE2 on x86-64): isfinite() value by value
   took ~0.6 us for 768 values on the development VM, this ~0.05. */
#define EXP_BITS 0x7f800000u
typedef uint32_t u32x4 __attribute__((vector_size(16)));
static int all_finite(const char* p, long long n) {
    const u32x4 e = {EXP_BITS, EXP_BITS, EXP_BITS, EXP_BITS};
    u32x4 acc = {0, 0, 0, 0};
    long long i = 0;
    for (; i + 4 <= n; i += 4) {
        u32x4 v;
        memcpy(&v, p + 4 * i, 16);
        acc |= (u32x4)((v & e) == e);
    }
    uint32_t bad = acc[0] | acc[1] | acc[2] | acc[3];
    for (; i < n; i++) bad |= (ld32(p + 4 * i) & EXP_BITS) == EXP_BITS;
    return !bad;
}

/* Layout of the connection: (dim, payload_off, rows_off, scores_off, blob_off, blob_size,
   flags, doorbell_word). Offsets are within the slot; doorbell_word indexes the header as u32. */
typedef struct { long long dim, payload, rows, scores, blob, blob_size, flags, bell_word; } Layout;

static int read_layout(PyObject* t, Layout* l) {
    long long* f[] = {&l->dim, &l->payload, &l->rows, &l->scores, &l->blob, &l->blob_size, &l->flags, &l->bell_word};
    if (!PyTuple_Check(t) || PyTuple_Size(t) != 8) {
        PyErr_SetString(PyExc_TypeError, "layout: a tuple of 8 ints");
        return -1;
    }
    for (int i = 0; i < 8; i++) {
        *f[i] = PyLong_AsLongLong(PyTuple_GetItem(t, i));
        if (*f[i] == -1 && PyErr_Occurred()) return -1;
        if (*f[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "layout: negative value");
            return -1;
        }
    }
    return 0;
}

/* The documents an ARENA_ENTRIES answer names (ArenaView.entry_docs), or Py_None when any
   check fails (Python then reads them its own way). info: (heap, heap_size, version). `blob` is
   this process's copy of the answer's blob, never the slot itself: an entry read twice from
   shared memory (checked, then used) could change in between and send the copy anywhere. */
static PyObject* entry_docs(const char* blob, uint64_t len, uint32_t n, PyObject* arena, PyObject* info) {
    if (arena == Py_None || len != 8 + (uint64_t)ENTRY_SIZE * n || n == 0) Py_RETURN_NONE;
    unsigned long long heap = 0, size = 0, version = 0;
    if (!PyTuple_Check(info) || PyTuple_Size(info) != 3) {
        PyErr_SetString(PyExc_TypeError, "arena_info: (heap, heap_size, version)");
        return NULL;
    }
    heap = PyLong_AsUnsignedLongLong(PyTuple_GetItem(info, 0));
    size = PyLong_AsUnsignedLongLong(PyTuple_GetItem(info, 1));
    version = PyLong_AsUnsignedLongLong(PyTuple_GetItem(info, 2));
    if (PyErr_Occurred()) return NULL;
    if (ld64(blob) != version) Py_RETURN_NONE;
    Py_buffer ab;
    if (PyObject_GetBuffer(arena, &ab, PyBUF_SIMPLE) < 0) return NULL;
    PyObject* out = NULL;
    if (heap > (unsigned long long)ab.len || size > (unsigned long long)ab.len - heap) goto none;
    for (uint32_t i = 0; i < n; i++) {  /* every entry checked before any copy */
        const char* e = blob + 8 + (uint64_t)ENTRY_SIZE * i;
        uint64_t off = ld64(e);
        uint32_t l = ld32(e + 8), gen = ld32(e + 12);
        if (!l || off > size || l > size - off || (gen & 1)) goto none;
    }
    out = PyList_New(n);
    if (!out) goto done;
    for (uint32_t i = 0; i < n; i++) {
        const char* e = blob + 8 + (uint64_t)ENTRY_SIZE * i;
        PyObject* d = PyBytes_FromStringAndSize((const char*)ab.buf + heap + ld64(e), ld32(e + 8));
        if (!d) { Py_CLEAR(out); goto done; }
        PyList_SetItem(out, i, d);  /* steals d */
    }
    goto done;
none:
    out = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&ab);
    return out;
}

/* The buffers of a call: the slot (writable), the query (C-contiguous, with its format) and,
   for recall1, the header. Each getter releases what it took when it fails. */
typedef struct { Py_buffer sb, qb, hb; int has_q, has_h; } Bufs;

static void release(Bufs* b) {
    PyBuffer_Release(&b->sb);
    if (b->has_q) PyBuffer_Release(&b->qb);
    if (b->has_h) PyBuffer_Release(&b->hb);
}

/* Take the slot and the query's buffers: 1 when taken, 0 when the query is strided (the caller
   copies it: nothing is written), -1 with an exception. */
static int get_slot_query(PyObject* slot, PyObject* query, Bufs* b) {
    b->has_q = b->has_h = 0;
    if (PyObject_GetBuffer(slot, &b->sb, PyBUF_WRITABLE) < 0) return -1;
    if (PyObject_GetBuffer(query, &b->qb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&b->sb);
        /* a strided query (numpy says ValueError, others BufferError): the caller copies it */
        if (!PyErr_ExceptionMatches(PyExc_BufferError) && !PyErr_ExceptionMatches(PyExc_ValueError)) return -1;
        PyErr_Clear();
        return 0;
    }
    b->has_q = 1;
    return 1;
}

/* 1 when the answer's areas lie in a slot of ``len`` bytes past its control words. */
static int answer_fits(const Layout* lay, long long k, Py_ssize_t len) {
    return len >= CTL_SIZE && lay->rows >= CTL_SIZE && lay->scores >= CTL_SIZE && lay->blob >= CTL_SIZE &&
           lay->rows + 4 * k <= len && lay->scores + 4 * k <= len && lay->blob + lay->blob_size <= len;
}

/* 1 when the query is ``dim`` float32 values, all finite (the caller writes it), 0 when it is
   not one this handles (nothing is written), -1 with an exception when the slot (or, given,
   the header of ``hdr_len`` bytes: recall1's) does not fit the layout. In this order, as
   recall1 always did: the query's format and length, the bounds, the finiteness. */
static int check_query(const Bufs* b, const Layout* lay, long long k, Py_ssize_t hdr_len) {
    const long long qbytes = 4 * lay->dim;
    const char* fmt = b->qb.format ? b->qb.format : "B";
    if (fmt[0] == '<' || fmt[0] == '=' || fmt[0] == '@') fmt++;
    if (b->qb.len != qbytes || strcmp(fmt, "f") != 0) return 0;  /* not dim float32 values */
    if (lay->payload < CTL_SIZE || lay->payload + qbytes > b->sb.len || !answer_fits(lay, k, b->sb.len) ||
        (hdr_len >= 0 && (lay->bell_word + 1) * 4 > hdr_len)) {
        PyErr_SetString(PyExc_ValueError, hdr_len >= 0 ? "recall1: the query, the slot or the header does not fit the layout"
                                                       : "request1: the query or the slot does not fit the layout");
        return -1;
    }
    return all_finite((const char*)b->qb.buf, lay->dim);
}

/* The request words and the query, before the state word (which the caller stores); the
   args (``alen`` bytes, request1's namespace and filter) are the caller's to write. */
static void write_request(char* s, const Layout* lay, const void* q, uint64_t seq, long long k, uint64_t deadline,
                          uint64_t alen) {
    const long long qbytes = 4 * lay->dim;
    memcpy(s + lay->payload, q, (size_t)qbytes);
    st64(s + OFF_SEQ, seq);
    st32(s + OFF_OP, OP_RECALL);
    st32(s + OFF_FLAGS, (uint32_t)lay->flags);
    st32(s + OFF_TOP_K, (uint32_t)k);
    st32(s + OFF_N_ITEMS, 1);
    st64(s + OFF_VEC_LEN, (uint64_t)qbytes);
    st64(s + OFF_ARGS_LEN, alen);
    st64(s + OFF_DEADLINE, deadline);
}

/* The answer in the slot whose state word read ``st``: the result tuple when it is one this
   handles (the slot's state then CLAIMED again), else ``waited`` as an int (left unread for
   Python). Each answer word is read from shared memory once (volatile: the compiler may not
   read it again), then checked and used from the copy: what another process writes meanwhile
   cannot pass the checks and then change what is read. */
static PyObject* read_answer(char* s, const Layout* lay, uint32_t st, uint64_t seq, long long k, uint64_t waited,
                             PyObject* arena, PyObject* info) {
    const volatile char* vs = s;
    const uint64_t resp_seq = *(const volatile uint64_t*)(vs + OFF_RESP_SEQ);
    const uint32_t status = *(const volatile uint32_t*)(vs + OFF_STATUS);
    const uint32_t n = *(const volatile uint32_t*)(vs + OFF_N_RESULTS);
    const uint64_t len = *(const volatile uint64_t*)(vs + OFF_RESP_LEN);
    const uint64_t flags = *(const volatile uint64_t*)(vs + OFF_RESP_FLAGS);
    if (st != ST_RESPONSE || resp_seq != seq || status != 0 || (flags & RESP_MORE) || n > (uint64_t)k ||
        len > (uint64_t)lay->blob_size)
        return PyLong_FromUnsignedLongLong((unsigned long long)waited);
    PyObject* rows = PyByteArray_FromStringAndSize(s + lay->rows, 4 * (Py_ssize_t)n);
    PyObject* scores = PyByteArray_FromStringAndSize(s + lay->scores, 4 * (Py_ssize_t)n);
    PyObject* blob = PyBytes_FromStringAndSize(s + lay->blob, (Py_ssize_t)len);
    PyObject* docs = NULL;
    if (rows && scores && blob) {
        if ((flags & (RESP_ARENA_DOCS | RESP_ARENA_ENTRIES)) == (RESP_ARENA_DOCS | RESP_ARENA_ENTRIES))
            docs = entry_docs(PyBytes_AsString(blob), len, n, arena, info);
        else
            docs = Py_NewRef(Py_None);
    }
    if (!docs) {
        Py_XDECREF(rows);
        Py_XDECREF(scores);
        Py_XDECREF(blob);
        return NULL;
    }
    __atomic_store_n((uint32_t*)s, (uint32_t)ST_CLAIMED, __ATOMIC_RELEASE);  /* read: ours again */
    return Py_BuildValue("(KIKNNNN)", (unsigned long long)waited, (unsigned int)n, (unsigned long long)flags,
                         rows, scores, blob, docs);  /* N: steals */
}

/* seq, k and a time in ns (recall1's and request1's deadline, answer1's wait) from args[0..2];
   -1 with an exception when one is bad. */
static int read_words(PyObject* const* args, unsigned long long* seq, long long* k, unsigned long long* ns) {
    *seq = PyLong_AsUnsignedLongLong(args[0]);
    *k = PyLong_AsLongLong(args[1]);
    *ns = PyLong_AsUnsignedLongLong(args[2]);
    if (PyErr_Occurred()) return -1;
    if (*k <= 0 || *k > 0x7fffffff) {
        PyErr_SetString(PyExc_ValueError, "k must be positive");
        return -1;
    }
    return 0;
}

/* recall1's exchange, its arguments checked: write the request and the query into slot ``s``,
   set DOORBELL, spin (the GIL released) until an answer, ``spin`` ns or the deadline, reading
   the header's doorbell word ``bell`` every CHECK_EVERY_NS, and read the answer (read_answer). */
static PyObject* exchange(char* s, const Layout* lay, const void* q, uint64_t seq, long long k, uint64_t deadline,
                          uint64_t spin, const uint32_t* bell, PyObject* arena, PyObject* info, uint64_t alen) {
    write_request(s, lay, q, seq, k, deadline, alen);
    uint32_t* state = (uint32_t*)s;
    uint32_t st = 0;
    uint64_t t0, t1;
    Py_BEGIN_ALLOW_THREADS
    /* the words above before the state word (a release store: in program order on x86) */
    __atomic_store_n(state, (uint32_t)ST_DOORBELL, __ATOMIC_RELEASE);
    t0 = now_ns();
    uint64_t until = t0 + spin;
    if (deadline && until > deadline) until = deadline;
    uint64_t check = t0 + CHECK_EVERY_NS;
    for (;;) {
        st = __atomic_load_n(state, __ATOMIC_ACQUIRE);
        if (st == ST_RESPONSE || st == ST_ERROR || st == ST_REQUEST) break;
        t1 = now_ns();
        if (t1 >= until) break;
        if (t1 >= check) {
            if (!__atomic_load_n(bell, __ATOMIC_ACQUIRE)) break;  /* the kernel stopped */
            check = t1 + CHECK_EVERY_NS;
        }
    }
    t1 = now_ns();
    Py_END_ALLOW_THREADS
    return read_answer(s, lay, st, seq, k, t1 - t0, arena, info);
}

PyDoc_STRVAR(recall1_doc,
"recall1(slot, query, layout, seq, k, deadline_ns, spin_ns, header, arena, arena_info[, args])\n"
"\n"
"Write a batch-1 DOORBELL recall into ``slot`` (a writable buffer over the whole slot) and\n"
"spin (the GIL released) for its answer for up to ``spin_ns``, at most until ``deadline_ns``\n"
"(CLOCK_MONOTONIC), reading the header's doorbell word every 50 us. ``args``: a recall's\n"
"args (protocol.encode_recall_args) the header lets it ring (protocol.ringable_args: a\n"
"namespace's, v1.5; and a filter's, v1.6), copied after the query at its 8-byte-aligned end\n"
"as request1 copies them.\n"
"ValueError when the query and the args do not fit the slot's payload.\n"
"\n"
"Returns None, having written nothing, when ``query`` is not ``dim`` finite float32 values in\n"
"one C-contiguous buffer: the caller takes its general path (which copies or refuses it).\n"
"Returns an int, the nanoseconds it spun, when the request was written but its answer is not\n"
"one this handles: the caller waits and reads it as usual. Returns ``(waited_ns, n_results, resp_flags, rows, scores, blob,\n"
"docs)`` for a RESPONSE with this ``seq``, status OK, no continuation, ``n_results <= k`` and a\n"
"blob that fits: rows and scores as bytearrays of ``n_results`` int32 / float32, the blob as\n"
"bytes, the documents as a list of bytes copied from ``arena`` (when its entries check) or\n"
"None; the slot's state is then CLAIMED again.\n");

static PyObject* recall1(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 10 && nargs != 11) {
        PyErr_SetString(PyExc_TypeError, "recall1 takes 10 or 11 arguments");
        return NULL;
    }
    Layout lay;
    unsigned long long seq, deadline;
    long long k;
    if (read_layout(args[2], &lay) < 0 || read_words(args + 3, &seq, &k, &deadline) < 0) return NULL;
    long long spin = PyLong_AsLongLong(args[6]);
    if (spin == -1 && PyErr_Occurred()) return NULL;
    if (spin < 0) {
        PyErr_SetString(PyExc_ValueError, "spin_ns must not be negative");
        return NULL;
    }
    Bufs b;
    int got = get_slot_query(args[0], args[1], &b);
    if (got <= 0) return got < 0 ? NULL : Py_NewRef(Py_None);
    if (PyObject_GetBuffer(args[7], &b.hb, PyBUF_SIMPLE) < 0) {
        release(&b);
        return NULL;
    }
    b.has_h = 1;
    PyObject* result = NULL;
    Py_buffer ab = {0};
    int has_a = 0;
    long long at = 0, alen = 0;  /* (declared before the first goto: none jumps over an initializer) */
    int ok = check_query(&b, &lay, k, b.hb.len);
    if (ok <= 0) {
        result = ok < 0 ? NULL : Py_NewRef(Py_None);
        goto out;
    }
    if (nargs == 11) {
        if (PyObject_GetBuffer(args[10], &ab, PyBUF_SIMPLE) < 0) goto out;
        has_a = 1;
    }
    /* the args at the query's 8-byte-aligned end, within the payload (which ends at the rows) */
    at = lay.payload + ((4 * lay.dim + 7) & ~7LL);
    alen = has_a ? (long long)ab.len : 0;
    if (alen && (lay.rows < lay.payload || at + alen > lay.rows || at + alen > b.sb.len)) {
        PyErr_SetString(PyExc_ValueError, "recall1: the query and the args do not fit the slot's payload");
        goto out;
    }
    if (alen) memcpy((char*)b.sb.buf + at, ab.buf, (size_t)alen);
    result = exchange((char*)b.sb.buf, &lay, b.qb.buf, seq, k, deadline, (uint64_t)spin,
                      (const uint32_t*)b.hb.buf + lay.bell_word, args[8], args[9], (uint64_t)alen);
out:
    if (has_a) PyBuffer_Release(&ab);
    release(&b);
    return result;
}

/* ------------------------------------------------------------------------------------------
 * bell1: the whole common recall to a resident kernel in one call. recall1 is the exchange;
 * around it KalosClient.recall spent ~3 us of Python on the H200 host (its checks, the slot
 * taken and given back, the wait's average, the result's arrays: benchmarks/client_overhead.py
 * --bell), ~6% of a 100k-row recall. bell1 makes the same checks and steps from a plan the
 * client keeps for its connection (KalosClient._plan_bell): anything unusual, before a word is
 * written, returns None and the client takes its usual path, which makes every check again
 * and says what is wrong. */

static unsigned long fork_gen;  /* counts forks, in the child: a plan made before one is not used after it */
static void in_child(void) { fork_gen++; }

PyDoc_STRVAR(fork_gen_doc, "fork_gen()\n\nHow many forks this process descends through since the module loaded (bell1's plans).");
static PyObject* fork_gen_now(PyObject* self, PyObject* unused) {
    (void)self;
    (void)unused;
    return PyLong_FromUnsignedLong(fork_gen);
}


enum { HDR_ARENA_VERSION = 62, HDR_CAR_EPOCH = 66, HDR_WORDS = 71 };  /* _conn.py's header u32 words */
enum { PLAN_CONN, PLAN_FREE, PLAN_HDR, PLAN_ARENA, PLAN_ARENA_BUF, PLAN_ARENA_INFO, PLAN_PACKED, PLAN_NDARRAY,
       PLAN_FROMBUFFER, PLAN_I32, PLAN_F32, PLAN_RESULT, PLAN_BELL1, PLAN_ITEMS };  /* (PLAN_BELL1: this function) */
/* the plan's packed words: the layout (as recall1's), the header's max_k, the spin, the arena
   version the plan's arena is (low, high), and fork_gen when the plan was made */
typedef struct { long long lay[8], max_k, spin_ns, arena_lo, arena_hi, fork_gen; } Packed;

static PyObject *s_conn, *s_dead, *s_arena_docs, *s_waiters, *s_timeout, *s_sem, *s_value, *s_mem, *s_seq,
    *s_pending, *s_typical, *s_release, *s_empty;

/* 1 when attribute ``name`` of ``o`` is true, 0 when false, -1 with an exception */
static int attr_true(PyObject* o, PyObject* name) {
    PyObject* v = PyObject_GetAttr(o, name);
    if (!v) return -1;
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    return t;
}

/* Give ``slot`` back as KalosClient._release does: to the free list unless it is pending;
   through _release itself (which wakes a waiting thread) when a thread waits for a slot. */
static int give_back(PyObject* client, PyObject* conn, PyObject* free_list, PyObject* slot) {
    int waiters = attr_true(client, s_waiters);
    if (waiters < 0) return -1;
    if (waiters) {
        PyObject* r = PyObject_CallMethodObjArgs(client, s_release, conn, slot, NULL);
        Py_XDECREF(r);
        return r ? 0 : -1;
    }
    int pending = attr_true(slot, s_pending);
    if (pending < 0) return -1;
    return pending ? 0 : PyList_Append(free_list, slot);
}

/* The client's wait average moved towards ``waited`` (client.py _ewma_wait). */
static int observe_wait(PyObject* client, uint64_t waited) {
    PyObject* v = PyObject_GetAttr(client, s_typical);
    if (!v) return -1;
    long long typical = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (typical == -1 && PyErr_Occurred()) return -1;
    long long w = (long long)waited;
    if (typical && w > 2 * typical) w = 2 * typical;
    v = PyLong_FromLongLong(typical + ((w - typical) >> 3));
    if (!v) return -1;
    int rc = PyObject_SetAttr(client, s_typical, v);
    Py_DECREF(v);
    return rc;
}

PyDoc_STRVAR(bell1_doc,
"bell1(client, plan, query, k)\n"
"\n"
"``client.recall(query, k)`` (the default namespace, no filter, documents, the client's timeout)\n"
"to the sidecar's resident kernel, whole: the checks, a free slot taken, recall1's exchange,\n"
"the wait's average, the slot given back and the RecallResult, from ``plan``\n"
"(KalosClient._plan_bell's tuple for the client's connection).\n"
"\n"
"Returns None, having taken and written nothing, when anything is unusual: the plan is not\n"
"the connection's now (another connection, a fork, a new arena version), the kernel is stopped\n"
"or takes no k this large, the carousel takes requests, no slot is free or a thread waits for\n"
"one, the slot's semaphore holds a post, or the query is not a 1-d float32 ndarray of ``dim``\n"
"finite values in one buffer, or k not an int in 1..max_k. Returns the RecallResult when the\n"
"answer and its documents were read here; else ``(slot, seq, deadline_ns, out)``, the request\n"
"written and spun on, with ``out`` what recall1 returned, for the client to carry on from.\n");

static PyObject* bell1(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "bell1 takes 4 arguments");
        return NULL;
    }
    PyObject *client = args[0], *plan = args[1], *query = args[2];
    if (!PyTuple_Check(plan) || PyTuple_Size(plan) != PLAN_ITEMS) {
        PyErr_SetString(PyExc_TypeError, "bell1: the plan is not KalosClient._plan_bell's tuple");
        return NULL;
    }
    PyObject* conn = PyTuple_GetItem(plan, PLAN_CONN);
    PyObject* free_list = PyTuple_GetItem(plan, PLAN_FREE);
    PyObject* packed = PyTuple_GetItem(plan, PLAN_PACKED);
    Packed p;
    if (!PyList_Check(free_list) || !PyBytes_Check(packed) || PyBytes_Size(packed) != (Py_ssize_t)sizeof p) {
        PyErr_SetString(PyExc_TypeError, "bell1: the plan is not KalosClient._plan_bell's tuple");
        return NULL;
    }
    memcpy(&p, PyBytes_AsString(packed), sizeof p);
    for (int i = 0; i < 8; i++)
        if (p.lay[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "bell1: the plan's layout has a negative value");
            return NULL;
        }
    if (p.spin_ns < 0) {
        PyErr_SetString(PyExc_ValueError, "bell1: the plan's spin is negative");
        return NULL;
    }
    if ((unsigned long)p.fork_gen != fork_gen) Py_RETURN_NONE;
    if (!PyLong_CheckExact(args[3])) Py_RETURN_NONE;
    long long k = PyLong_AsLongLong(args[3]);
    if (k == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (k <= 0 || k > p.max_k || Py_TYPE(query) != (PyTypeObject*)PyTuple_GetItem(plan, PLAN_NDARRAY))
        Py_RETURN_NONE;
    Layout lay;
    memcpy(&lay, p.lay, sizeof lay);
    /* the client: still on this connection, which is alive; arena documents; no thread waiting */
    PyObject* now_conn = PyObject_GetAttr(client, s_conn);
    if (!now_conn) return NULL;
    Py_DECREF(now_conn);  /* (compared by identity only) */
    if (now_conn != conn) Py_RETURN_NONE;
    int t;
    if ((t = attr_true(conn, s_dead)) != 0) return t < 0 ? NULL : Py_NewRef(Py_None);
    if ((t = attr_true(client, s_waiters)) != 0) return t < 0 ? NULL : Py_NewRef(Py_None);
    PyObject* ad = PyObject_GetAttr(client, s_arena_docs);
    if (!ad) return NULL;
    Py_DECREF(ad);
    if (ad == Py_False) Py_RETURN_NONE;
    PyObject* to = PyObject_GetAttr(client, s_timeout);
    if (!to) return NULL;
    double timeout = PyFloat_AsDouble(to);
    Py_DECREF(to);
    if (timeout == -1.0 && PyErr_Occurred()) return NULL;
    if (!(timeout > 0 && timeout < 1e9)) Py_RETURN_NONE;

    Py_buffer hb, qb, sb;
    if (PyObject_GetBuffer(PyTuple_GetItem(plan, PLAN_HDR), &hb, PyBUF_SIMPLE) < 0) return NULL;
    PyObject* result = NULL;
    PyObject* slot = NULL;
    if (hb.len < 4 * HDR_WORDS || (lay.bell_word + 1) * 4 > hb.len) {
        PyErr_SetString(PyExc_ValueError, "bell1: the header does not fit the plan");
        goto out_h;
    }
    const volatile uint32_t* h = (const volatile uint32_t*)hb.buf;
    if (h[HDR_ARENA_VERSION] != (uint32_t)p.arena_lo || h[HDR_ARENA_VERSION + 1] != (uint32_t)p.arena_hi ||
        (uint64_t)k > h[lay.bell_word] || (k <= CAR_KMAX && (*(const volatile uint64_t*)(h + HDR_CAR_EPOCH) & 1))) {
        /* a new arena; the kernel stopped or k past its reach; the carousel runs and may take
           this k (the client's path writes into its slots then: KalosClient._recall_one) */
        result = Py_NewRef(Py_None);
        goto out_h;
    }
    if (PyObject_GetBuffer(query, &qb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_BufferError) && !PyErr_ExceptionMatches(PyExc_ValueError)) goto out_h;
        PyErr_Clear();  /* strided: the usual path copies it */
        result = Py_NewRef(Py_None);
        goto out_h;
    }
    const char* fmt = qb.format ? qb.format : "B";
    if (fmt[0] == '<' || fmt[0] == '=' || fmt[0] == '@') fmt++;
    if (qb.ndim != 1 || qb.len != 4 * lay.dim || strcmp(fmt, "f") != 0 || !all_finite((const char*)qb.buf, lay.dim)) {
        result = Py_NewRef(Py_None);
        goto out_q;
    }
    /* a free slot (list.pop, under the GIL as in KalosClient._acquire) */
    Py_ssize_t n_free = PyList_Size(free_list);
    if (n_free <= 0) {
        result = Py_NewRef(Py_None);
        goto out_q;
    }
    slot = Py_NewRef(PyList_GetItem(free_list, n_free - 1));
    if (PyList_SetSlice(free_list, n_free - 1, n_free, NULL) < 0) {
        Py_CLEAR(slot);
        goto out_q;
    }
    /* from here the slot is ours: given back on every way out */
    PyObject* sem = PyObject_GetAttr(slot, s_sem);
    int posted = sem ? attr_true(sem, s_value) : -1;
    Py_XDECREF(sem);
    if (posted != 0) {  /* a post left by an answer seen by spinning: the usual path drains it */
        if (posted > 0) result = Py_NewRef(Py_None);
        goto out_give;
    }
    PyObject* mem = PyObject_GetAttr(slot, s_mem);
    if (!mem) goto out_give;
    int got = PyObject_GetBuffer(mem, &sb, PyBUF_WRITABLE);
    Py_DECREF(mem);
    if (got < 0) goto out_give;
    if (lay.payload < CTL_SIZE || lay.payload + 4 * lay.dim > sb.len || !answer_fits(&lay, k, sb.len)) {
        PyErr_SetString(PyExc_ValueError, "bell1: the slot does not fit the plan's layout");
        goto out_s;
    }
    PyObject* so = PyObject_GetAttr(slot, s_seq);
    if (!so) goto out_s;
    unsigned long long seq = PyLong_AsUnsignedLongLong(so);
    Py_DECREF(so);
    if (seq == (unsigned long long)-1 && PyErr_Occurred()) goto out_s;
    so = PyLong_FromUnsignedLongLong(++seq);  /* (wraps at 2**64, as & 0xFFFFFFFFFFFFFFFF) */
    if (!so) goto out_s;
    got = PyObject_SetAttr(slot, s_seq, so);
    Py_DECREF(so);
    if (got < 0) goto out_s;
    const uint64_t deadline = now_ns() + (uint64_t)(timeout * 1e9);
    PyObject* out = exchange((char*)sb.buf, &lay, qb.buf, seq, k, deadline, (uint64_t)p.spin_ns, (const uint32_t*)hb.buf + lay.bell_word,
                             PyTuple_GetItem(plan, PLAN_ARENA_BUF), PyTuple_GetItem(plan, PLAN_ARENA_INFO), 0);
    PyBuffer_Release(&sb);
    if (!out) goto out_give;
    /* read whole (its documents too), and the client still on this connection: the result */
    if (PyTuple_Check(out) && PyTuple_GetItem(out, 6) != Py_None) {
        PyObject* again = PyObject_GetAttr(client, s_conn);
        Py_XDECREF(again);
        if (!again) {
            Py_DECREF(out);
            goto out_give;
        }
        if (again == conn) {
            PyObject* rows = NULL;
            PyObject* scores = NULL;
            uint64_t waited = PyLong_AsUnsignedLongLong(PyTuple_GetItem(out, 0));
            if (!PyErr_Occurred() && observe_wait(client, waited) == 0 &&
                (rows = PyObject_CallFunctionObjArgs(PyTuple_GetItem(plan, PLAN_FROMBUFFER), PyTuple_GetItem(out, 3),
                                                     PyTuple_GetItem(plan, PLAN_I32), NULL)) &&
                (scores = PyObject_CallFunctionObjArgs(PyTuple_GetItem(plan, PLAN_FROMBUFFER), PyTuple_GetItem(out, 4),
                                                       PyTuple_GetItem(plan, PLAN_F32), NULL)))
                result = PyObject_CallFunctionObjArgs(PyTuple_GetItem(plan, PLAN_RESULT), rows, scores,
                                                      PyTuple_GetItem(out, 6), Py_None, s_empty, NULL);
            Py_XDECREF(rows);
            Py_XDECREF(scores);
            Py_DECREF(out);
            goto out_give;
        }
    }
    /* written and spun on, the answer not read whole here: the client carries on (and gives the slot back) */
    const int unread = PyLong_Check(out);  /* (the request may still be answered) */
    result = Py_BuildValue("(OKKN)", slot, seq, (unsigned long long)deadline, out);
    if (!result && unread) {  /* (no memory) the slot stays out of circulation, as an abandoned request's */
        PyObject *et, *ev, *etb;
        PyErr_Fetch(&et, &ev, &etb);
        PyObject* pend = PyLong_FromUnsignedLongLong(seq);
        if (!pend || PyObject_SetAttr(slot, s_pending, pend) < 0) PyErr_Clear();
        Py_XDECREF(pend);
        PyErr_Restore(et, ev, etb);
    } else if (!result) {
        goto out_give;  /* (answered and read: the slot is free) */
    }
    Py_CLEAR(slot);
    goto out_q;
out_s:
    PyBuffer_Release(&sb);
out_give: {
    PyObject *et, *ev, *etb;  /* (an exception on the way out is kept over give_back's) */
    PyErr_Fetch(&et, &ev, &etb);
    if (give_back(client, conn, free_list, slot) < 0) {
        if (et)
            PyErr_Clear();
        else
            Py_CLEAR(result);
    }
    if (et) PyErr_Restore(et, ev, etb);
    Py_CLEAR(slot);
}
out_q:
    PyBuffer_Release(&qb);
out_h:
    PyBuffer_Release(&hb);
    return result;
}

PyDoc_STRVAR(request1_doc,
"request1(slot, query, layout, seq, k, deadline_ns[, args])\n"
"\n"
"Write a batch-1 recall into ``slot`` as a REQUEST, for the sidecar (whose doorbell semaphore\n"
"the caller then posts, and whose answer it waits for as usual, then reads with ``answer1``).\n"
"``args``: the recall's args blob (protocol.encode_recall_args: a namespace, a filter), copied\n"
"after the query at its 8-byte-aligned end; none or empty for the default namespace without a\n"
"filter. Returns True once written; None, having written nothing, when ``query`` is not ``dim``\n"
"finite float32 values in one C-contiguous buffer (the caller takes its general path).\n"
"ValueError when the query and the args do not fit the slot's payload.\n");

static PyObject* request1(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6 && nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "request1 takes 6 or 7 arguments");
        return NULL;
    }
    Layout lay;
    unsigned long long seq, deadline;
    long long k;
    if (read_layout(args[2], &lay) < 0 || read_words(args + 3, &seq, &k, &deadline) < 0) return NULL;
    Py_buffer ab = {0};
    int has_a = 0;
    if (nargs == 7) {
        if (PyObject_GetBuffer(args[6], &ab, PyBUF_SIMPLE) < 0) return NULL;
        has_a = 1;
    }
    Bufs b;
    PyObject* result = NULL;
    int got = get_slot_query(args[0], args[1], &b);
    if (got <= 0) {
        if (got == 0) result = Py_NewRef(Py_None);
        goto out;
    }
    int ok = check_query(&b, &lay, k, -1);
    /* the args at the query's 8-byte-aligned end, within the payload (which ends at the rows) */
    const long long at = lay.payload + ((4 * lay.dim + 7) & ~7LL), alen = has_a ? (long long)ab.len : 0;
    if (ok > 0 && alen && (lay.rows < lay.payload || at + alen > lay.rows || at + alen > b.sb.len)) {
        PyErr_SetString(PyExc_ValueError, "request1: the query and the args do not fit the slot's payload");
        ok = -1;
    }
    if (ok > 0) {
        char* s = (char*)b.sb.buf;
        if (alen) memcpy(s + at, ab.buf, (size_t)alen);
        write_request(s, &lay, b.qb.buf, seq, k, deadline, (uint64_t)alen);
        /* the words above before the state word (a release store: in program order on x86) */
        __atomic_store_n((uint32_t*)s, (uint32_t)ST_REQUEST, __ATOMIC_RELEASE);
        result = Py_NewRef(Py_True);
    } else if (ok == 0) {
        result = Py_NewRef(Py_None);
    }
    release(&b);
out:
    if (has_a) PyBuffer_Release(&ab);
    return result;
}

PyDoc_STRVAR(answer1_doc,
"answer1(slot, layout, seq, k, waited_ns, arena, arena_info)\n"
"\n"
"Read the answer to the batch-1 recall ``seq`` that ``request1`` wrote, once the caller has\n"
"seen the slot's state change: what ``recall1`` returns for an answer it handles (the slot's\n"
"state then CLAIMED again; ``waited_ns`` is passed through as the first item), or None, with\n"
"the slot untouched, for any other (an error, a continuation, a sequence or length that does\n"
"not check): the caller reads it as usual.\n");

static PyObject* answer1(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "answer1 takes 7 arguments");
        return NULL;
    }
    Layout lay;
    unsigned long long seq, waited;
    long long k;
    if (read_layout(args[1], &lay) < 0 || read_words(args + 2, &seq, &k, &waited) < 0) return NULL;
    Py_buffer sb;
    if (PyObject_GetBuffer(args[0], &sb, PyBUF_WRITABLE) < 0) return NULL;
    PyObject* result = NULL;
    if (!answer_fits(&lay, k, sb.len)) {  /* the control words too: read_answer reads and writes them */
        PyErr_SetString(PyExc_ValueError, "answer1: the slot does not fit the layout");
    } else {
        char* s = (char*)sb.buf;
        const uint32_t st = __atomic_load_n((const uint32_t*)s, __ATOMIC_ACQUIRE);
        result = read_answer(s, &lay, st, seq, k, waited, args[5], args[6]);
        if (result && PyLong_Check(result)) {  /* not one read here: None, for Python to read */
            Py_DECREF(result);
            result = Py_NewRef(Py_None);
        }
    }
    PyBuffer_Release(&sb);
    return result;
}

/* ------------------------------------------------------------------------------------------
 * The carousel's direct slots (protocol v1.4, KALOS_CAROUSEL=direct): a client writes its
 * batch-1 recall into carousel slot i itself and reads the kernel's answer there; the wait
 * between the two is KalosClient._wait_direct's (its sleeps and its checks of the epoch, the
 * sidecar's life and the deadline in Python, its spin car_wait1's). A slot's u32 words
 * (protocol.py W_*; the kernel's CAR_HEAD_BYTES):
 * [0] state [1] k [2] namespace [3] seq [4] results [5] seq echoed [6] ns aboard [7] the
 * namespace's rows at the launch; the float32 query at byte 32; rows and scores at the layout's
 * offsets. tests/unit/test_fastpath_carousel.py checks these against the module's CAR_WORDS. */
enum { CW_STATE = 0, CW_K = 1, CW_SEQ = 3, CW_RESULTS = 4, CW_RESP_SEQ = 5, CW_ELIGIBLE = 7, CAR_HEAD = 32 };
#define ARENA_HEADER 64  /* arena.ARENA_HEADER_SIZE: the row table's first entry */

/* 1 when the n float32 values at p are all finite; their largest |x| in *amax (four at a time,
   as all_finite: a finite |x|'s bits order as its value). */
static int finite_amax(const char* p, long long n, float* amax) {
    const u32x4 e = {EXP_BITS, EXP_BITS, EXP_BITS, EXP_BITS}, abs_ = e | 0x007fffffu;
    u32x4 bad4 = {0, 0, 0, 0}, top4 = {0, 0, 0, 0};
    long long i = 0;
    for (; i + 4 <= n; i += 4) {
        u32x4 v;
        memcpy(&v, p + 4 * i, 16);
        v &= abs_;
        bad4 |= (u32x4)((v & e) == e);
        const u32x4 up = (u32x4)(v > top4);
        top4 = (v & up) | (top4 & ~up);
    }
    uint32_t bad = bad4[0] | bad4[1] | bad4[2] | bad4[3], top = 0;
    for (int j = 0; j < 4; j++) top = top4[j] > top ? top4[j] : top;
    for (; i < n; i++) {
        const uint32_t a = ld32(p + 4 * i) & 0x7fffffffu;
        bad |= (a & EXP_BITS) == EXP_BITS;
        top = a > top ? a : top;
    }
    memcpy(amax, &top, 4);
    return !bad;
}

PyDoc_STRVAR(car_request1_doc,
"car_request1(segment, at, query, dim, seq, k, lo, hi)\n"
"\n"
"Write a batch-1 recall into the carousel slot at byte ``at`` of ``segment`` (a writable buffer\n"
"over the carousel's segment): the query at ``at + 32``, the words k, seq and results (all ones),\n"
"then the state CAR_REQUEST, last. The slot's namespace and row-count words are the sidecar's.\n"
"\n"
"Returns True once written; None, having written nothing, when the slot still holds a request\n"
"(REQUEST or TAKEN: an earlier one given up at its deadline), ``k`` is outside [1, 32], or\n"
"``query`` is not ``dim`` finite float32 values in one C-contiguous buffer whose largest |x|\n"
"lies in [lo, hi] (protocol.car_takes): the caller then asks the usual way. ValueError when\n"
"the query's place, ``at + 32`` to ``at + 32 + 4 * dim``, is not inside ``segment``.\n");

static PyObject* car_request1(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "car_request1 takes 8 arguments");
        return NULL;
    }
    long long at, dim, k;
    unsigned long long seq;
    double lo, hi;
    if ((at = PyLong_AsLongLong(args[1])) == -1 && PyErr_Occurred()) return NULL;
    if ((dim = PyLong_AsLongLong(args[3])) == -1 && PyErr_Occurred()) return NULL;
    if ((seq = PyLong_AsUnsignedLongLong(args[4])) == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if ((k = PyLong_AsLongLong(args[5])) == -1 && PyErr_Occurred()) return NULL;
    if ((lo = PyFloat_AsDouble(args[6])) == -1.0 && PyErr_Occurred()) return NULL;
    if ((hi = PyFloat_AsDouble(args[7])) == -1.0 && PyErr_Occurred()) return NULL;
    if (at < 0 || (at & 3) || dim < 1) {
        PyErr_SetString(PyExc_ValueError, "car_request1: at must be a non-negative multiple of 4, dim positive");
        return NULL;
    }
    Bufs b;
    int got = get_slot_query(args[0], args[2], &b);
    if (got <= 0) return got < 0 ? NULL : Py_NewRef(Py_None);
    PyObject* result = NULL;
    const char* fmt = b.qb.format ? b.qb.format : "B";
    if (fmt[0] == '<' || fmt[0] == '=' || fmt[0] == '@') fmt++;
    const long long qbytes = 4 * dim;
    if (dim > (long long)b.sb.len / 4 || at > (long long)b.sb.len - CAR_HEAD - qbytes) {  /* (no overflow) */
        PyErr_SetString(PyExc_ValueError, "car_request1: the query does not fit the slot");
        goto out;
    }
    char* s = (char*)b.sb.buf + at;
    uint32_t* state = (uint32_t*)s;
    const uint32_t st = __atomic_load_n(state, __ATOMIC_ACQUIRE);
    float amax = 0.f;
    if (strcmp(fmt, "f") != 0 || b.qb.len != qbytes || st == CAR_REQUEST || st == CAR_TAKEN || k < 1 || k > CAR_KMAX ||
        !finite_amax((const char*)b.qb.buf, qbytes / 4, &amax) || !((double)amax >= lo && (double)amax <= hi)) {
        result = Py_NewRef(Py_None);
        goto out;
    }
    memcpy(s + CAR_HEAD, b.qb.buf, (size_t)qbytes);
    st32(s + 4 * CW_K, (uint32_t)k);
    st32(s + 4 * CW_SEQ, (uint32_t)seq);
    st32(s + 4 * CW_RESULTS, 0xffffffffu);
    __atomic_store_n(state, (uint32_t)CAR_REQUEST, __ATOMIC_RELEASE);  /* last (in program order on x86) */
    result = Py_NewRef(Py_True);
out:
    release(&b);
    return result;
}

PyDoc_STRVAR(car_answer1_doc,
"car_answer1(segment, at, rows_off, scores_off, seq, k, arena, arena_info)\n"
"\n"
"Read the kernel's answer to the direct recall ``seq`` (its low 32 bits) in the carousel slot at\n"
"byte ``at`` of ``segment``: ``(rows, scores, docs)``, rows and scores as bytearrays of n int32 /\n"
"float32 and docs as a list of bytes, each hit's document as the arena's row table holds it now,\n"
"read under its entry's seqlock (gen, even; offset and length; gen again, unchanged), as\n"
"ArenaView.current_docs. ``arena`` and ``arena_info`` are ArenaView.fast's (the arena's buffer;\n"
"its heap's offset, size and version).\n"
"\n"
"None, for the caller to ask the usual way, when the state is not CAR_DONE, the seq echo differs,\n"
"n is not min(k, the slot's row count word), or a hit's document cannot be read (a row outside\n"
"the table, no document, an entry being written). The caller still checks the carousel's epoch\n"
"after this returns (the documents are the rows' only while the kernel's stop has not ended).\n");

static PyObject* car_answer1(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "car_answer1 takes 8 arguments");
        return NULL;
    }
    long long at, rows_off, scores_off, k;
    unsigned long long seq, heap, heap_size;
    if ((at = PyLong_AsLongLong(args[1])) == -1 && PyErr_Occurred()) return NULL;
    if ((rows_off = PyLong_AsLongLong(args[2])) == -1 && PyErr_Occurred()) return NULL;
    if ((scores_off = PyLong_AsLongLong(args[3])) == -1 && PyErr_Occurred()) return NULL;
    if ((seq = PyLong_AsUnsignedLongLong(args[4])) == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if ((k = PyLong_AsLongLong(args[5])) == -1 && PyErr_Occurred()) return NULL;
    if (!PyTuple_Check(args[7]) || PyTuple_Size(args[7]) != 3) {
        PyErr_SetString(PyExc_TypeError, "arena_info: (heap, heap_size, version)");
        return NULL;
    }
    if ((heap = PyLong_AsUnsignedLongLong(PyTuple_GetItem(args[7], 0))) == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if ((heap_size = PyLong_AsUnsignedLongLong(PyTuple_GetItem(args[7], 1))) == (unsigned long long)-1 &&
        PyErr_Occurred())
        return NULL;
    if (at < 0 || (at & 3) || rows_off < CAR_HEAD || scores_off < CAR_HEAD || k < 1 || k > CAR_KMAX) {
        PyErr_SetString(PyExc_ValueError, "car_answer1: bad offsets or k");
        return NULL;
    }
    Py_buffer sb, ab;
    if (PyObject_GetBuffer(args[0], &sb, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[6], &ab, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&sb);
        return NULL;
    }
    PyObject *result = NULL, *rows_b = NULL, *scores_b = NULL, *docs = NULL;
    const long long room = (long long)sb.len - at - 4 * CAR_KMAX;  /* (at, rows_off, scores_off >= 0: no overflow) */
    if (at > (long long)sb.len || rows_off > room || scores_off > room) {
        PyErr_SetString(PyExc_ValueError, "car_answer1: the answer does not fit the segment");
        goto done;
    }
    if (heap > (unsigned long long)ab.len || heap_size > (unsigned long long)ab.len - heap || heap < ARENA_HEADER)
        goto none;
    const char* s = (const char*)sb.buf + at;
    const volatile uint32_t* w = (const volatile uint32_t*)s;
    const uint32_t st = __atomic_load_n((const uint32_t*)s, __ATOMIC_ACQUIRE);  /* the words after it */
    const uint32_t resp_seq = w[CW_RESP_SEQ], n = w[CW_RESULTS], eligible = w[CW_ELIGIBLE];
    if (st != CAR_DONE || resp_seq != (uint32_t)seq || n != (uint32_t)(k < eligible ? k : eligible)) goto none;
    int32_t rows[CAR_KMAX];
    const volatile int32_t* vrows = (const volatile int32_t*)(s + rows_off);
    for (uint32_t i = 0; i < n; i++) rows[i] = vrows[i];  /* one read (volatile): checked and used from this copy */
    const char* a = (const char*)ab.buf;
    const unsigned long long cap = (heap - ARENA_HEADER) / ENTRY_SIZE;
    docs = PyList_New(n);
    if (!docs) goto done;
    for (uint32_t i = 0; i < n; i++) {
        if (rows[i] < 0 || (unsigned long long)rows[i] >= cap) goto none;
        const volatile char* e = (const volatile char*)(a + ARENA_HEADER + (uint64_t)ENTRY_SIZE * (uint32_t)rows[i]);
        const uint32_t g0 = __atomic_load_n((const uint32_t*)(e + 12), __ATOMIC_ACQUIRE);
        const uint64_t off = *(const volatile uint64_t*)e;
        const uint32_t len = *(const volatile uint32_t*)(e + 8);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);  /* (x86-64: loads stay in order anyway) */
        if ((g0 & 1) || !len || off > heap_size || len > heap_size - off) goto none;
        PyObject* d = PyBytes_FromStringAndSize(a + heap + off, len);
        if (!d) goto done;
        PyList_SetItem(docs, i, d);  /* steals d */
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (*(const volatile uint32_t*)(e + 12) != g0) goto none;  /* rewritten while copied */
    }
    rows_b = PyByteArray_FromStringAndSize((const char*)rows, 4 * (Py_ssize_t)n);
    scores_b = PyByteArray_FromStringAndSize(s + scores_off, 4 * (Py_ssize_t)n);
    if (!rows_b || !scores_b) goto done;
    result = Py_BuildValue("(NNN)", rows_b, scores_b, docs);  /* N: steals */
    rows_b = scores_b = docs = NULL;
    goto done;
none:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(rows_b);
    Py_XDECREF(scores_b);
    Py_XDECREF(docs);
    PyBuffer_Release(&ab);
    PyBuffer_Release(&sb);
    return result;
}

PyDoc_STRVAR(car_wait1_doc,
"car_wait1(segment, at, until_ns)\n"
"\n"
"Spin, the GIL released, on the state word of the carousel slot at byte ``at`` of ``segment``\n"
"while it reads REQUEST or TAKEN, until ``until_ns`` (CLOCK_MONOTONIC) at most; return the\n"
"state last read. The spin part of KalosClient._wait_direct: its checks (the epoch, the\n"
"sidecar's life, the deadline) stay in Python, between calls of at most a millisecond.\n");

static PyObject* car_wait1(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "car_wait1 takes 3 arguments");
        return NULL;
    }
    long long at;
    unsigned long long until;
    if ((at = PyLong_AsLongLong(args[1])) == -1 && PyErr_Occurred()) return NULL;
    if ((until = PyLong_AsUnsignedLongLong(args[2])) == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    Py_buffer sb;
    if (PyObject_GetBuffer(args[0], &sb, PyBUF_SIMPLE) < 0) return NULL;
    if (at < 0 || (at & 3) || at > (long long)sb.len - 4) {
        PyBuffer_Release(&sb);
        PyErr_SetString(PyExc_ValueError, "car_wait1: the state word is not inside the segment");
        return NULL;
    }
    const uint32_t* state = (const uint32_t*)((const char*)sb.buf + at);
    uint32_t st;
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        st = __atomic_load_n(state, __ATOMIC_ACQUIRE);
        if ((st != CAR_REQUEST && st != CAR_TAKEN) || now_ns() >= until) break;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();  /* (a spinning hyperthread leaves its core's sibling the pipeline) */
#endif
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&sb);
    return PyLong_FromUnsignedLong(st);
}

static PyMethodDef methods[] = {
    {"recall1", (PyCFunction)(void (*)(void))recall1, METH_FASTCALL, recall1_doc},
    {"request1", (PyCFunction)(void (*)(void))request1, METH_FASTCALL, request1_doc},
    {"answer1", (PyCFunction)(void (*)(void))answer1, METH_FASTCALL, answer1_doc},
    {"car_request1", (PyCFunction)(void (*)(void))car_request1, METH_FASTCALL, car_request1_doc},
    {"car_answer1", (PyCFunction)(void (*)(void))car_answer1, METH_FASTCALL, car_answer1_doc},
    {"car_wait1", (PyCFunction)(void (*)(void))car_wait1, METH_FASTCALL, car_wait1_doc},
    {"bell1", (PyCFunction)(void (*)(void))bell1, METH_FASTCALL, bell1_doc},
    {"fork_gen", (PyCFunction)(void (*)(void))fork_gen_now, METH_NOARGS, fork_gen_doc},
    {NULL, NULL, 0, NULL},
};

static int exec_module(PyObject* m) {
    static int once;
    if (!once) {  /* the attribute names bell1 reads, and its fork counter */
        PyObject** names[] = {&s_conn, &s_dead, &s_arena_docs, &s_waiters, &s_timeout, &s_sem, &s_value, &s_mem,
                              &s_seq, &s_pending, &s_typical, &s_release, &s_empty};
        const char* strs[] = {"_conn", "dead", "arena_docs", "_waiters", "timeout", "sem", "value", "mem",
                              "seq", "pending", "_typical_wait_ns", "_release", ""};
        for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
            if (!(*names[i] = PyUnicode_InternFromString(strs[i]))) return -1;
        if (pthread_atfork(NULL, NULL, in_child) != 0) {
            PyErr_SetString(PyExc_OSError, "pthread_atfork failed");
            return -1;
        }
        once = 1;
    }
    PyObject* offs = Py_BuildValue("{sisisisisisisisisisisisisisi}", "state", OFF_STATE, "seq", OFF_SEQ,
                                   "op", OFF_OP, "flags", OFF_FLAGS, "top_k", OFF_TOP_K, "n_items", OFF_N_ITEMS,
                                   "vec_len", OFF_VEC_LEN, "args_len", OFF_ARGS_LEN, "deadline_ns", OFF_DEADLINE,
                                   "resp_seq", OFF_RESP_SEQ, "status", OFF_STATUS, "n_results", OFF_N_RESULTS,
                                   "resp_len", OFF_RESP_LEN, "resp_flags", OFF_RESP_FLAGS);
    if (!offs) return -1;
    int rc = PyModule_AddObjectRef(m, "CTL_OFFSETS", offs);
    Py_DECREF(offs);
    if (rc < 0) return -1;
    PyObject* car = Py_BuildValue("{sisisisisisisisisisisisisi}", "state", CW_STATE, "k", CW_K, "seq", CW_SEQ,
                                  "results", CW_RESULTS, "resp_seq", CW_RESP_SEQ, "eligible", CW_ELIGIBLE,
                                  "head", CAR_HEAD, "request", CAR_REQUEST, "taken", CAR_TAKEN, "done", CAR_DONE,
                                  "kmax", CAR_KMAX, "arena_header", ARENA_HEADER, "entry_size", ENTRY_SIZE);
    if (!car) return -1;
    rc = PyModule_AddObjectRef(m, "CAR_WORDS", car);
    Py_DECREF(car);
    if (rc < 0) return -1;
    PyObject* bell = Py_BuildValue("{sisisisisi}", "arena_version", HDR_ARENA_VERSION, "carousel_epoch", HDR_CAR_EPOCH,
                                   "header_words", HDR_WORDS, "plan_items", PLAN_ITEMS, "packed_bytes", (int)sizeof(Packed));
    if (!bell) return -1;
    rc = PyModule_AddObjectRef(m, "BELL_WORDS", bell);
    Py_DECREF(bell);
    if (rc < 0) return -1;
    /* request1 takes a scoped recall's args (session 46): a client finding an extension built
       before sends such recalls the general way */
    if (PyModule_AddIntConstant(m, "REQUEST1_ARGS", 1) < 0) return -1;
    /* recall1 takes a namespace's args (session 48: the resident kernel serves namespaces) */
    return PyModule_AddIntConstant(m, "RECALL1_ARGS", 1);
}

static PyModuleDef_Slot slots[] = {{Py_mod_exec, exec_module}, {0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fastpath",
    "The batch-1 recall to a resident GPU kernel, in C (see recall1).", 0, methods, slots, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fastpath(void) { return PyModuleDef_Init(&module); }
