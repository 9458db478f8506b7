// Kalos recall kernels: exact top-k over vectors resident in device memory.
//
// Loaded in exactly one place (sidecar/cuda_kernels.py), compiled once at sidecar start by NVRTC
// through cupy.RawModule, with the template instantiations listed there. The file compiles on
// its own too: CI runs `nvcc -arch=sm_90 -c kernels/recall.cu`.
//
// Data path of one recall (batch 1):
//   the client writes its float32 query into its shared-memory slot, which the sidecar has
//   registered with cudaHostRegister(mapped): the slot's host address is a device address.
//   The host writes a small Desc (below) into another registered buffer and launches the
//   slot's CUDA graph of two kernels:
//     prep_queries   one block (batches: one per query): reads the Desc's head and the query from host memory (PCIe;
//                    the slot's addresses are baked into the graph), takes norms, normalizes
//                    for cosine, writes float / half / int8 queries + params to device memory
//                    (so the scan does not read host memory from every block);
//     scan_topk      every block streams its share of rows with 16-byte loads, scores them
//                    against the queries held in shared memory, keeps a per-block top-k in a
//                    threshold-filtered shared-memory buffer, appends what can still matter to
//                    a global list (see "the global bound"); the last block to finish merges
//                    that list and writes rows and scores straight into the response area of
//                    the slot (host memory).
//   No full score array, no sort of all scores, no host round trip between stages.
//
// Batches of several queries take another path, a threshold top-k: each query's threshold from a
// sample of rows (tau_scores), every score that reaches it appended to a candidate list, the
// list's top-k (select_cands). Float16 rows are scored and filtered in one pass by tensor cores
// (mma_filter, sm_80 and later); float32 rows by one cuBLAS GEMM into a scores matrix, then
// filter_scores; topk_scores (per-block selection over the matrix) when a list would overflow.

#include <cuda_fp16.h>

#ifndef KALOS_BLOCK
#define KALOS_BLOCK 256          // threads per block of the scan and select kernels
#endif
#ifndef KALOS_MAXQ
#define KALOS_MAXQ 64            // most queries one Desc describes
#endif

// Candidates each thread loads per round in the merges and in topk_scores. A candidate buffer
// must hold k plus one round: the host sizes it as pow2(pow2(k) + MERGE_UNROLL * KALOS_BLOCK).
#define MERGE_UNROLL 4
// blocks' maxima each lane of kth_of_maxima holds: grids of up to 32 x this many blocks (640;
// the H200's largest is 4 x 132 = 528; 24 made the int8 resident kernel spill)
#define MAXIMA_PER_LANE 20
// kth_of_maxima's float loop for batch 1: the warp's largest by __reduce_max_sync (sm_80 on);
// 0: by shuffles, as the batched scans (in the QB = 8 L2 scan it made ptxas spill 12 bytes)
#ifndef KALOS_MAXIMA_REDUX
#define KALOS_MAXIMA_REDUX 1
#endif
#define KALOS_CAND_MAX 4096      // most int8 candidates per query (CAND_MAX in sidecar/index_gpu.py)
// 1: the scan's blocks take their rows a round at a time from a counter (sync_rows), so a
// block slowed by its neighbours takes fewer rounds and the blocks finish together; 0: a fixed
// grid-stride share each (S9-6: at 1M rows the blocks' scans ended 15-88 us apart).
#ifndef KALOS_DYNAMIC_ROWS
#define KALOS_DYNAMIC_ROWS 1
#endif
// 1 (with KALOS_DYNAMIC_ROWS): a scan hands its rows out last to first when the one before it
// handed them out first to last, and the other way round (a flag in `sync` the last block flips).
// A scan streams more rows than L2 holds (H200: 60 MB; 100k float16 rows of 768 are 154 MB), so
// what L2 still holds afterwards is some of the rows it read last; a scan that starts where the
// last one ended finds those there. H200, in process, builds alternated twice (S15-1): 100k
// float16 rows 52.0 -> 49.4 µs scan + merge, 1M 357.3 -> 354.7, int8 1M 211.0 -> 208.4 (about
// 11 MB fewer read from DRAM). (Keeping the first 37.5 MB of rows in L2 set aside for persisting
// lines, evict_last, instead cost 40-80 µs at 1M: the set-aside slowed every scan, S15-2. Without
// a set-aside, by eviction priority alone: the first 32 MB evict_last and the rest evict_first
// took 0.7 µs off a 100k scan on an H100 and nothing at 1M, S50-2..4; not kept,
// docs/experiments/2026-12-06-s50-l2-keep-priorities.patch.)
#ifndef KALOS_ALTERNATE
#define KALOS_ALTERNATE 1
#endif

// The L2 prefetch size of the scan's row loads (PTX ld.global.nc.L2::<n>B, sm_75 and later):
// 0 (a plain __ldg), 64, 128 or 256 bytes. A warp of the int8 resident kernel reads 32 bytes
// of each of 16 rows per load, so without a hint DRAM sees a row a sector at a time; with one,
// the first load of a row's 256 bytes asks for all of them. Float rows and int8 rows separately.
#ifndef KALOS_L2PF_I8
#define KALOS_L2PF_I8 0
#endif
// 16-byte loads each thread has in flight per row piece in the scan of int8 rows (float rows: 8);
// _SPLIT: in the split scan below (8 there made the int8 resident kernel spill at 128 registers)
#ifndef KALOS_UNROLL_I8
#define KALOS_UNROLL_I8 8
#endif
#ifndef KALOS_UNROLL_I8_SPLIT
#define KALOS_UNROLL_I8_SPLIT 6
#endif
#ifndef KALOS_L2PF_F
#define KALOS_L2PF_F 0
#endif
// 1: the scan of one query's rows takes whole spans of loads without per-chunk bounds checks,
// then a checked tail (see scan_body); 0: every chunk checked. int8 rows and float rows
// separately. Scans of several queries at once keep the checked loop: with the split, int8's
// took 89 registers at 8 queries and spilled 24 bytes at 4 (not measured). Measured on the H200 (S14-1, 1M rows, resident kernel, builds alternated): int8
// 231.3 / 231.4 -> 228.0 / 226.8 µs (on, with 6 loads in flight and 2 blocks per SM); float16
// 362.7 -> 440.4 µs (on: 8 bytes spilled at its 80 registers), so float rows keep 0.
#ifndef KALOS_SCAN_SPLIT_I8
#define KALOS_SCAN_SPLIT_I8 1
#endif
#ifndef KALOS_SCAN_SPLIT_F
#define KALOS_SCAN_SPLIT_F 0
#endif

// Where the last block's time goes (benchmarks/merge_stamps.py builds with -DKALOS_STAMPS):
// %globaltimer stamps and counts of the last block of a batch-1 scan, in a device array the
// benchmark reads. Without the macro these are empty statements: the sidecar's code is the same.
#ifdef KALOS_STAMPS
extern "C" {
__device__ unsigned long long kalos_stamps[24];  // (unmangled: the benchmark looks it up by name)
}
#define KALOS_T(v) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(v))
#define KALOS_STAMP(i) do { if (threadIdx.x == 0) { unsigned long long t_; KALOS_T(t_); kalos_stamps[i] = t_; } } while (0)
#define KALOS_COUNT(i, v) do { if (threadIdx.x == 0) kalos_stamps[i] = (unsigned long long)(v); } while (0)
#else
#define KALOS_STAMP(i) do { } while (0)
#define KALOS_COUNT(i, v) do { } while (0)
#endif

// Measurement knobs for benchmarks/scan_variants.py (0 in the sidecar: nothing is skipped).
// Each bit removes one part of scan_topk so that a variant's time, against the full kernel's,
// says what that part costs. A variant with any bit set returns wrong answers.
#ifndef KALOS_PROBE
#define KALOS_PROBE 0
#endif
#define PROBE_NO_OFFERS 1   // score every row but offer none (no atomics, no compaction)
#define PROBE_NO_TAIL 2     // skip the block's final compact, append and the last block's merge
#define PROBE_NO_NS 4       // do not read the namespace and mask arrays
#define PROBE_NO_SYNC 8     // no __syncthreads per round (only meaningful with NO_OFFERS)
#define PROBE_EMPTY 16      // return right after loading the queries (launch + set-up only)
#define PROBE_NO_APPEND 32  // the block's final compact, then return (no append, no merge)
#define PROBE_NO_MERGE 64   // append and elect the last block, which skips the merge

#define METRIC_COSINE 0
#define METRIC_IP 1
#define METRIC_L2 2

// ns_id NS_ANY (set by the host on the GEMM path): every row below n_rows is eligible (the
// namespace covers [0, n_rows) without holes), so the top-k kernels read the scores alone, not
// the namespace array too.
#define NS_ANY (-2)
// ns_id NS_LIST: `mask` points to an int32 list of n_rows rows (device memory), the rows a
// selective filter keeps, each eligible: the scan walks the list instead of rows [0, n_rows)
// and never reads the namespace array. scan_list and the resident kernel take it; the GEMM
// paths never see it. (NS_NONE, -3, is the resident kernel's empty default namespace.)
#define NS_LIST (-4)

typedef unsigned long long u64;

// Written by the host into registered (mapped) memory before each launch.
struct Desc {
    int n_queries;               // B
    int k;                       // results per query (<= rows eligible)
    int n_rows;                  // rows [0, n_rows) are scanned
    int ns_id;                   // only rows of this namespace are eligible
    u64 mask;                    // device pointer to uint8[n_rows] (1 = eligible), or 0
    int out_ld;                  // elements between consecutive queries' results in out_*
    int seq;                     // echoed into Params (debugging)
    u64 q[KALOS_MAXQ];           // host-mapped float32[dim] of each query
    u64 out_rows[KALOS_MAXQ];    // host-mapped int32 results of each query (out_ld apart)
    u64 out_scores[KALOS_MAXQ];  // host-mapped float32 results of each query
};

// Device copy of what the scan needs, written by prep_queries.
struct Params {
    int n_queries, k, n_rows, ns_id;
    const unsigned char* mask;
    int out_ld, seq;
    int* out_rows[KALOS_MAXQ];
    float* out_scores[KALOS_MAXQ];
    float qnorm2[KALOS_MAXQ];    // squared norms of the (normalized) queries, for L2
    float qscale[KALOS_MAXQ];    // int8 copy of each query = round(q / qscale) (int8 storage)
};

// ------------------------------------------------------------------------------------------
// helpers

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// Tagged records: each u64 carries a tag in its high half and one 32-bit value in its low
// half, written and read with volatile (relaxed, system-scope) accesses, for which an aligned
// 64-bit access is single-copy atomic and a v2.u64 access is two of them: a reader that sees
// its tag in every u64 it needs has the writer's values, with no fence and no count between
// them (NCCL's LL protocol does the same with its flags). The int8 resident kernel's
// candidate records and the batch-1 scan's block lists (ll_merge) use them.
__device__ __forceinline__ u64 vload64(const u64* p) { return *reinterpret_cast<const volatile u64*>(p); }
__device__ __forceinline__ void vstore64(u64* p, u64 v) { *reinterpret_cast<volatile u64*>(p) = v; }
__device__ __forceinline__ ulonglong2 vload128(const u64* p) {
    ulonglong2 v;
    asm volatile("ld.volatile.global.v2.u64 {%0,%1}, [%2];" : "=l"(v.x), "=l"(v.y) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void vstore128(u64* p, u64 a, u64 b) {
    asm volatile("st.volatile.global.v2.u64 [%0], {%1,%2};" : : "l"(p), "l"(a), "l"(b) : "memory");
}
__device__ __forceinline__ bool tagged(ulonglong2 v, unsigned int tag) {
    return (unsigned int)(v.x >> 32) == tag && (unsigned int)(v.y >> 32) == tag;
}

// Loads of 16 bytes hold VEC elements of the storage type.
template <typename T> struct Vec;
template <> struct Vec<float> {
    static constexpr int N = 4;
    static constexpr bool INT8 = false;
    __device__ __forceinline__ static float dot(uint4 v, const float* qrow, int ch) {
        float4 a = *reinterpret_cast<const float4*>(qrow + ch * N);
        return __uint_as_float(v.x) * a.x + __uint_as_float(v.y) * a.y
             + __uint_as_float(v.z) * a.z + __uint_as_float(v.w) * a.w;
    }
};
template <> struct Vec<__half> {
    static constexpr int N = 8;
    static constexpr bool INT8 = false;
    __device__ __forceinline__ static float dot(uint4 v, const float* qrow, int ch) {
        const float* q = qrow + ch * N;
        const __half2* h = reinterpret_cast<const __half2*>(&v);
        float4 a = *reinterpret_cast<const float4*>(q);
        float4 b = *reinterpret_cast<const float4*>(q + 4);
        float2 f0 = __half22float2(h[0]), f1 = __half22float2(h[1]);
        float2 f2 = __half22float2(h[2]), f3 = __half22float2(h[3]);
        float acc = f0.x * a.x;
        acc = fmaf(f0.y, a.y, acc); acc = fmaf(f1.x, a.z, acc); acc = fmaf(f1.y, a.w, acc);
        acc = fmaf(f2.x, b.x, acc); acc = fmaf(f2.y, b.y, acc); acc = fmaf(f3.x, b.z, acc);
        return fmaf(f3.y, b.w, acc);
    }
};
// int8 rows against the int8 copy of the query (held as bytes at the start of the query's row
// of shared memory): four dp4a per 16 bytes instead of 16 conversions and 16 FMAs, which made
// the int8 scan compute-bound. The product is scaled by row scale x query scale at the offer.
template <> struct Vec<signed char> {
    static constexpr int N = 16;
    static constexpr bool INT8 = true;
    __device__ __forceinline__ static float dot(uint4 v, const float* qrow, int ch) {
        int4 a = reinterpret_cast<const int4*>(qrow)[ch];
        int acc = __dp4a((int)v.x, a.x, 0);
        acc = __dp4a((int)v.y, a.y, acc);
        acc = __dp4a((int)v.z, a.z, acc);
        acc = __dp4a((int)v.w, a.w, acc);
        return (float)acc;
    }
    // the same product as an int (KALOS_SCAN_SPLIT_I8: summed as ints over the row, converted once)
    __device__ __forceinline__ static int dot_i(uint4 v, const float* qrow, int ch) {
        int4 a = reinterpret_cast<const int4*>(qrow)[ch];
        int acc = __dp4a((int)v.x, a.x, 0);
        acc = __dp4a((int)v.y, a.y, acc);
        acc = __dp4a((int)v.z, a.z, acc);
        return __dp4a((int)v.w, a.w, acc);
    }
};

// A 16-byte load through the read-only path, with an L2 prefetch size of PF bytes (0: none).
template <int PF>
__device__ __forceinline__ uint4 ld_row(const uint4* p) {
    static_assert(PF == 0 || PF == 64 || PF == 128 || PF == 256, "L2 prefetch sizes: 0, 64, 128, 256");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
    if constexpr (PF != 0) {
        uint4 v;
        if constexpr (PF == 64)
            asm("ld.global.nc.L2::64B.v4.u32 {%0, %1, %2, %3}, [%4];"
                : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
        else if constexpr (PF == 128)
            asm("ld.global.nc.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];"
                : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
        else
            asm("ld.global.nc.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
        return v;
    }
#endif
    return __ldg(p);
}

// Sort n (a power of two) (key, val) pairs in shared memory, descending by key; ties by val
// ascending so results are deterministic. All threads of the block must call it.
__device__ void bitonic_desc(float* key, int* val, int n) {
    for (int size = 2; size <= n; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int t = threadIdx.x; t < (n >> 1); t += blockDim.x) {
                // 2 * stride * (t / stride) + t % stride, by bit operations: stride is a power
                // of two, and an integer division by a run-time divisor costs dozens of
                // instructions per element per pass
                int i = ((t & ~(stride - 1)) << 1) | (t & (stride - 1));
                int j = i + stride;
                float a = key[i], b = key[j];
                int va = val[i], vb = val[j];
                // "a belongs after b" in descending order
                bool a_after_b = (a < b) || (a == b && va > vb);
                bool up = (i & size) == 0;   // this run sorts descending
                if (up == a_after_b) {
                    key[i] = b; key[j] = a;
                    val[i] = vb; val[j] = va;
                }
            }
            __syncthreads();
        }
    }
}

__device__ __forceinline__ int next_pow2(int x) {
    int p = 1;
    while (p < x) p <<= 1;
    return p;
}

// ---- compact's top-k by warp selection (KALOS_WARP_SELECT) ------------------------------
//
// For k <= 32 a candidate buffer's best k need no sort of the whole buffer: a bitonic sort of
// 256-512 keys is 36-45 block-wide barrier steps, and at the end of a batch-1 scan the block
// that finishes last runs one on the answer's critical path (merge_stamps.py: "loop end ->
// append done" 8.4 µs at 100k rows). Here each warp takes 64 of the keys (two per lane, in
// registers) and picks its best k, one per round: the warp's largest key by one redux, the
// smallest row among the lanes holding it by another, the lane that held it moves on to its
// second. Warp 0 then merges the warps' sorted lists the same way. Three barriers in all (one
// when the keys fit one warp), and 2k rounds of a few instructions each. Measured on the H200
// (S21-2): that block's "loop end -> append done" 8.3 -> 4.0 µs and the merge's final sort
// 1.7 -> 1.25 at 100k rows (the graph's scan, 264 blocks); the resident kernel's scan + merge
// 49.0 -> 47.7 µs, its round trip in process 58.5 -> 57.6; 1M unchanged.
//
// The order is bitonic_desc's: score descending, ties by row ascending, on the scores' ordered
// bit patterns (sel_ord: -0 counted as +0, which it equals; a NaN, never offered, as -inf).
// Padding is (-inf, INT_MAX), as compact's. The result is compact's: the best min(n, k) first,
// in order, cnt and thr updated.
#ifndef KALOS_WARP_SELECT
#define KALOS_WARP_SELECT 1
#endif

__device__ __forceinline__ int sel_ord(float f) {
    const int i = __float_as_int(f == f ? f + 0.f : neg_inf());
    return i >= 0 ? i : i ^ 0x7fffffff;
}
__device__ __forceinline__ float sel_key(int o) { return __int_as_float(o >= 0 ? o : o ^ 0x7fffffff); }
__device__ __forceinline__ int warp_max_i(int v) {
#if __CUDA_ARCH__ >= 800
    return __reduce_max_sync(0xffffffffu, v);
#else
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
#endif
}
__device__ __forceinline__ int warp_min_i(int v) {
#if __CUDA_ARCH__ >= 800
    return __reduce_min_sync(0xffffffffu, v);
#else
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
#endif
}

// One round of a warp's selection: the best (o, v) of the warp's heads, to every lane; the
// lane that held it (the lowest, for padding's duplicates) is told so through `won`.
__device__ __forceinline__ void sel_round(int o, int v, int& m, int& mv, bool& won) {
    m = warp_max_i(o);
    mv = warp_min_i(o == m ? v : 0x7fffffff);
    const unsigned int who = __ballot_sync(0xffffffffu, o == m && v == mv);
    won = (threadIdx.x & 31) == (unsigned int)(__ffs(who) - 1);
}

// True when it compacted (all threads call it; false, with nothing done, where it does not
// apply: k > 32, more keys than two per thread, more than 32 warps, or no room for the lists).
__device__ bool warp_select(float* key, int* val, int* cnt, float* thr, int k, int buf) {
    const int n = *cnt;
    const int nw = blockDim.x >> 5, w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const bool single = n <= 64;  // block-uniform: one warp does it all
    if (k > 32 || n > 64 * nw || nw > 32 || (!single && (nw + 1) * k > buf)) return false;
    const int kk = n < k ? n : k;  // results
    int o0 = sel_ord(neg_inf()), v0 = 0x7fffffff, o1 = o0, v1 = v0;
    const int nmine = min(max(n - 64 * w, 0), 64);  // this warp's keys
    if (!single || w == 0) {
        const int i = 64 * w + lane;
        if (lane < nmine) { o0 = sel_ord(key[i]); v0 = val[i]; }
        if (lane + 32 < nmine) { o1 = sel_ord(key[i + 32]); v1 = val[i + 32]; }
        if (o1 > o0 || (o1 == o0 && v1 < v0)) {  // the lane's better one first
            const int to = o0, tv = v0;
            o0 = o1; v0 = v1; o1 = to; v1 = tv;
        }
    }
    // every key is in registers before any list overwrites the buffer
    if (single) __syncwarp(); else __syncthreads();
    int m = 0, mv = 0;
    if (!single || w == 0) {
        const int out = single ? 0 : k + k * w;  // the results, or warp w's list
        const int rounds = nmine < k ? nmine : k;
        for (int r = 0; r < rounds; r++) {  // warp-uniform
            bool won;
            sel_round(o0, v0, m, mv, won);
            if (won) { o0 = o1; v0 = v1; o1 = sel_ord(neg_inf()); v1 = 0x7fffffff; }
            if (lane == 0) { key[out + r] = sel_key(m); val[out + r] = mv; }
        }
    }
    if (!single) {
        __syncthreads();
        if (w == 0) {  // merge the warps' lists (list j: min(k, its keys) entries at k + k * j)
            const int len = lane < nw ? min(min(max(n - 64 * lane, 0), 64), k) : 0;
            int at = 0;
            int ho = sel_ord(neg_inf()), hv = 0x7fffffff;
            if (len > 0) { ho = sel_ord(key[k + k * lane]); hv = val[k + k * lane]; }
            for (int r = 0; r < kk; r++) {
                bool won;
                sel_round(ho, hv, m, mv, won);
                if (won) {
                    ho = sel_ord(neg_inf()); hv = 0x7fffffff;
                    if (++at < len) { ho = sel_ord(key[k + k * lane + at]); hv = val[k + k * lane + at]; }
                }
                if (lane == 0) { key[r] = sel_key(m); val[r] = mv; }
            }
        }
    }
    if (threadIdx.x == 0) {  // thread 0 wrote every result: m is the last (the k-th when kk == k)
        *cnt = kk;
        *thr = kk == k ? sel_key(m) : neg_inf();
    }
    __syncthreads();
    return true;
}

// ---- compact's top-k by sorting networks in registers (KALOS_SORT_SELECT) ----------------
//
// warp_select's rounds each wait on two warp reductions and a ballot, one after another: the
// H200 took ~3.3 µs for a block's final selection (up to 512 keys) and ~3.5 µs for ll_merge's
// k-th of 396 heads (merge_stamps.py, S23-1), on the answer's path both. Here each key and its
// row become one 64-bit word that orders as the answer does (sel_pack: score descending by
// sel_ord, then row ascending), each warp sorts its 64 words (two per lane) with a bitonic
// network of shuffles (15 steps across lanes, 6 within a lane, no barrier), and the warps'
// best 32 are merged pairwise, three levels of one step each (the best 32 of two sorted lists
// are the larger of each pair, one list reversed) and five shuffles to order it; up to 32 keys,
// one per lane of one warp. Same contract and same results as warp_select (k <= 32, up to 64
// keys per warp of the block). Measured (S23-2, S23-3): a block's 512 keys 3.3 -> 2.3 µs, the
// k-th of 396 heads 3.8 -> 2.8, ~10 keys 1.4 -> 0.8.
#ifndef KALOS_SORT_SELECT
#define KALOS_SORT_SELECT 1
#endif

__device__ __forceinline__ u64 sel_pack(float f, int v) {
    return ((u64)((unsigned int)sel_ord(f) ^ 0x80000000u) << 32) | (u64)(0xFFFFFFFFu - (unsigned int)v);
}
__device__ __forceinline__ float sel_pack_key(u64 w) { return sel_key((int)((unsigned int)(w >> 32) ^ 0x80000000u)); }
__device__ __forceinline__ int sel_pack_val(u64 w) { return (int)(0xFFFFFFFFu - (unsigned int)w); }
__device__ __forceinline__ u64 max64(u64 a, u64 b) { return a > b ? a : b; }
__device__ __forceinline__ u64 min64(u64 a, u64 b) { return a < b ? a : b; }

// Sort the warp's 64 words descending: element 2 * lane + j is x[j] (on return, the
// (2 * lane + j)-th largest).
__device__ __forceinline__ void warp_sort64(u64& x0, u64& x1) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int size = 2; size <= 64; size <<= 1) {
        const bool desc = ((2 * lane) & size) == 0;  // this run's direction (all descending at 64)
#pragma unroll
        for (int stride = size >> 1; stride > 1; stride >>= 1) {
            const int lm = stride >> 1;  // the partner of element 2 * lane + j is 2 * (lane ^ lm) + j
            const u64 p0 = __shfl_xor_sync(0xffffffffu, x0, lm), p1 = __shfl_xor_sync(0xffffffffu, x1, lm);
            const bool hi = ((lane & lm) == 0) == desc;  // this lane keeps the larger
            x0 = hi ? max64(x0, p0) : min64(x0, p0);
            x1 = hi ? max64(x1, p1) : min64(x1, p1);
        }
        if ((x0 < x1) == desc) { const u64 t = x0; x0 = x1; x1 = t; }  // stride 1: within the lane
    }
}

// Order a bitonic sequence of 32 (one word per lane) descending.
__device__ __forceinline__ u64 warp_clean32(u64 x) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int lm = 16; lm > 0; lm >>= 1) {
        const u64 p = __shfl_xor_sync(0xffffffffu, x, lm);
        x = (lane & lm) == 0 ? max64(x, p) : min64(x, p);
    }
    return x;
}

__device__ bool sort_select(float* key, int* val, int* cnt, float* thr, int k) {
    __shared__ u64 s_best[KALOS_BLOCK / 32][32];  // each warp's best 32, then the merges'
    const int n = *cnt;
    const int nw = blockDim.x >> 5, w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (k > 32 || n > 64 * nw || nw > KALOS_BLOCK / 32) return false;
    const int kk = n < k ? n : k;  // results
    const int lists = n > 64 ? (n + 63) >> 6 : 1;  // warps with keys (one when there are none)
    const u64 pad = sel_pack(neg_inf(), 0x7fffffff);
    u64 x0 = pad, x1 = pad;
    if (w < lists && n > 32) {
        const int i = 64 * w + 2 * lane;
        if (i < n) x0 = sel_pack(key[i], val[i]);
        if (i + 1 < n) x1 = sel_pack(key[i + 1], val[i + 1]);
        warp_sort64(x0, x1);
    }
    u64 best = pad;  // lane i: the i-th best (warp 0, at the end)
    if (n <= 32) {  // block-uniform: one key per lane of warp 0, a 32-key network (15 steps, not
        // 21 with twice the shuffles: ll_merge's final selection of ~10 keys 1.47 -> 0.77 µs,
        // the resident kernel's round trip at 100k -0.5 µs, S23-3)
        if (w == 0) {
            best = lane < n ? sel_pack(key[lane], val[lane]) : pad;
#pragma unroll
            for (int size = 2; size <= 32; size <<= 1) {
                const bool desc = (lane & size) == 0;
#pragma unroll
                for (int stride = size >> 1; stride > 0; stride >>= 1) {
                    const u64 p = __shfl_xor_sync(0xffffffffu, best, stride);
                    best = (((lane & stride) == 0) == desc) ? max64(best, p) : min64(best, p);
                }
            }
        }
        __syncthreads();  // every key read before the results overwrite them
    } else if (lists == 1) {  // block-uniform: warp 0 alone
        if (w == 0) {
            const int src = lane >> 1;
            const u64 a = __shfl_sync(0xffffffffu, x0, src), b = __shfl_sync(0xffffffffu, x1, src);
            best = (lane & 1) ? b : a;
        }
        __syncthreads();  // every key read before the results overwrite them
    } else {
        if (w < lists) {
            const int src = lane >> 1;
            const u64 a = __shfl_sync(0xffffffffu, x0, src), b = __shfl_sync(0xffffffffu, x1, src);
            s_best[w][lane] = (lane & 1) ? b : a;
        }
        for (int d = 1; d < lists; d <<= 1) {  // lists w and w + d -> w
            __syncthreads();
            if ((w & (2 * d - 1)) == 0 && w + d < lists) {
                const u64 x = max64(s_best[w][lane], s_best[w + d][31 - lane]);
                best = warp_clean32(x);
                s_best[w][lane] = best;
            }
        }
        __syncthreads();  // (also: every key read before the results overwrite them)
        if (w == 0) best = s_best[0][lane];
    }
    if (w == 0 && lane < kk) {
        key[lane] = sel_pack_key(best);
        val[lane] = sel_pack_val(best);
    }
    if (w == 0 && lane == (kk > 0 ? kk - 1 : 0)) {  // the k-th (when kk == k) is this lane's
        *cnt = kk;
        *thr = kk == k ? sel_pack_key(best) : neg_inf();
    }
    __syncthreads();
    return true;
}

// Shrink a candidate buffer to its best k (sorted first), update the threshold.
// cnt and thr live in shared memory; all threads call it.
__device__ void compact(float* key, int* val, int* cnt, float* thr, int k, int buf) {
    int n = *cnt;
    int p = next_pow2(n < 2 ? 2 : n);
    if (p > buf) p = buf;
    for (int i = n + threadIdx.x; i < p; i += blockDim.x) { key[i] = neg_inf(); val[i] = 0x7fffffff; }
    __syncthreads();
    bitonic_desc(key, val, p);
    if (threadIdx.x == 0) {
        int keep = n < k ? n : k;
        *cnt = keep;
        // once k candidates are held, nothing at or below the k-th can enter the top-k
        *thr = (keep == k) ? key[k - 1] : neg_inf();
    }
    __syncthreads();
}

// compact, by sort_select (or warp_select, built with -DKALOS_SORT_SELECT=0) where it applies
// (KALOS_WARP_SELECT) and SEL: for a block's compaction after its scan, the selections of
// ll_merge and the appended lists' merge's last one. Not in make_room (inlined into the scan
// loop, warp_select took the float16 graph scan from 64 registers to 80 and a spill), nor in
// int8's kernels (their merges keep RESCORE_FACTOR x k > 32 candidates, and the code made
// their resident kernels spill).
template <bool SEL>
__device__ void compact_top(float* key, int* val, int* cnt, float* thr, int k, int buf) {
    if (SEL && KALOS_WARP_SELECT) {
        if (KALOS_SORT_SELECT ? sort_select(key, val, cnt, thr, k) : warp_select(key, val, cnt, thr, k, buf)) return;
    }
    compact(key, val, cnt, thr, k, buf);
}

// ------------------------------------------------------------------------------------------
// prep_queries: <<<1, 256>>> for one query from a slot (q0 != nullptr), <<<queries, 256>>> for
// a batch described by the Desc

template <int METRIC>
__global__ void __launch_bounds__(KALOS_BLOCK)
prep_queries(const Desc* __restrict__ desc, Params* __restrict__ params,
             float* __restrict__ qbuf, __half* __restrict__ qbuf_h, signed char* __restrict__ qbuf_i8,
             int dim, int ld, const float* q0, int* r0, float* s0) {
    // q0 != nullptr: one query from one slot whose addresses are baked into the launch (a
    // per-slot graph), so the descriptor's head and the query are read from host memory in the
    // same wave: one PCIe round trip instead of two dependent ones. Otherwise every address
    // comes from the descriptor.
    __shared__ Desc d;
    const int c4 = ld / 4;  // ld is a multiple of 4 (8 for float16, 16 for int8)
    const uint4* src = reinterpret_cast<const uint4*>(desc);
    uint4* dst = reinterpret_cast<uint4*>(&d);
    if (q0 != nullptr) {
        uint4 h = make_uint4(0u, 0u, 0u, 0u);
        if (threadIdx.x < 2) h = src[threadIdx.x];  // the 32-byte head: counts, k, rows, mask
        float4 v[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int e = 4 * (u * blockDim.x + threadIdx.x);
            v[u] = make_float4(0.f, 0.f, 0.f, 0.f);
            // a slot's payload is 128-byte aligned: 16-byte loads wherever 4 elements remain
            if (e + 3 < dim) v[u] = *reinterpret_cast<const float4*>(q0 + e);
            else if (e < dim) {
                v[u].x = q0[e];
                if (e + 1 < dim) v[u].y = q0[e + 1];
                if (e + 2 < dim) v[u].z = q0[e + 2];
            }
        }
        if (threadIdx.x < 2) dst[threadIdx.x] = h;
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int idx = u * blockDim.x + threadIdx.x;
            if (idx < c4) reinterpret_cast<float4*>(qbuf)[idx] = v[u];
        }
        for (int base = 4 * blockDim.x; base < c4; base += blockDim.x) {  // dims above 4096
            int idx = base + threadIdx.x, e = 4 * idx;
            if (idx < c4) {
                float4 w = make_float4(0.f, 0.f, 0.f, 0.f);
                if (e < dim) w.x = q0[e];
                if (e + 1 < dim) w.y = q0[e + 1];
                if (e + 2 < dim) w.z = q0[e + 2];
                if (e + 3 < dim) w.w = q0[e + 3];
                reinterpret_cast<float4*>(qbuf)[idx] = w;
            }
        }
        __syncthreads();
        d.n_queries = 1;
        if (threadIdx.x == 0) {
            params->n_queries = 1; params->k = d.k; params->n_rows = d.n_rows;
            params->ns_id = d.ns_id; params->mask = reinterpret_cast<const unsigned char*>(d.mask);
            params->out_ld = d.out_ld; params->seq = d.seq;
            params->out_rows[0] = r0; params->out_scores[0] = s0;
        }
        __syncthreads();
    } else {
    // Batches: block b prepares queries b, b + gridDim.x, ... (the host launches one block per
    // query, so that no block loops over 64 queries' PCIe reads and norms: one block took 25 us
    // for 8 queries and 64 us for 64 on the H200). Every block reads the descriptor; block 0
    // writes the fields of Params that are not per query.
    // 1. the descriptor, in one wave of 16-byte reads of host memory
    for (int i = threadIdx.x; i < (int)(sizeof(Desc) / 16); i += blockDim.x) dst[i] = src[i];
    __syncthreads();
    const int nq = d.n_queries, nb = gridDim.x, b = blockIdx.x;
    if (b == 0 && threadIdx.x == 0) {
        params->n_queries = nq; params->k = d.k; params->n_rows = d.n_rows;
        params->ns_id = d.ns_id; params->mask = reinterpret_cast<const unsigned char*>(d.mask);
        params->out_ld = d.out_ld; params->seq = d.seq;
    }
    for (int q = b + nb * threadIdx.x; q < nq; q += nb * blockDim.x) {
        params->out_rows[q] = reinterpret_cast<int*>(d.out_rows[q]);
        params->out_scores[q] = reinterpret_cast<float*>(d.out_scores[q]);
    }
    // 2. this block's queries, all reads of host memory issued before any is used
    const int total = (b < nq ? (nq - b + nb - 1) / nb : 0) * c4;
    for (int base = 0; base < total; base += 4 * blockDim.x) {
        float4 v[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int idx = base + u * blockDim.x + threadIdx.x;
            v[u] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (idx < total) {
                int q = b + nb * (idx / c4), e = 4 * (idx % c4);
                const float* x = reinterpret_cast<const float*>(d.q[q]) + e;
                // a slot payload is 128-byte aligned, but query j of a batch starts j*dim floats
                // later: 16-byte loads only where the address allows them
                if (e + 3 < dim && (reinterpret_cast<u64>(x) & 15) == 0) {
                    v[u] = *reinterpret_cast<const float4*>(x);
                } else if (e + 3 < dim) {
                    v[u] = make_float4(x[0], x[1], x[2], x[3]);
                } else {
                    if (e < dim) v[u].x = x[0];
                    if (e + 1 < dim) v[u].y = x[1];
                    if (e + 2 < dim) v[u].z = x[2];
                }
            }
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int idx = base + u * blockDim.x + threadIdx.x;
            if (idx < total) reinterpret_cast<float4*>(qbuf)[(size_t)(b + nb * (idx / c4)) * c4 + idx % c4] = v[u];
        }
    }
    __syncthreads();
    }
    const int nq = d.n_queries;
    // 3. one warp per query: norm, normalization (cosine), float16 copy for the GEMM path,
    //    int8 copy (scale max|q|/127) for int8 storage
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int q = blockIdx.x + gridDim.x * warp; q < nq; q += gridDim.x * (blockDim.x / 32)) {
        float* x = qbuf + (size_t)q * ld;
        float s = 0.f, amax = 0.f;
        for (int i = lane; i < ld; i += 32) { s += x[i] * x[i]; amax = fmaxf(amax, fabsf(x[i])); }
        for (int o = 16; o > 0; o >>= 1) {
            s += __shfl_xor_sync(0xffffffff, s, o);
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, o));
        }
        float scale = (METRIC == METRIC_COSINE && s > 0.f) ? rsqrtf(s) : 1.f;
        amax *= scale;
        float qs = amax > 0.f ? amax / 127.f : 1.f, inv = 1.f / qs;
        for (int i = lane; i < ld; i += 32) {
            float v = x[i] * scale;
            x[i] = v;
            qbuf_h[(size_t)q * ld + i] = __float2half_rn(v);
            qbuf_i8[(size_t)q * ld + i] = (signed char)(int)fminf(fmaxf(rintf(v * inv), -127.f), 127.f);
        }
        if (lane == 0) {
            params->qnorm2[q] = (METRIC == METRIC_COSINE && s > 0.f) ? 1.f : s;
            params->qscale[q] = qs;
        }
    }
}

// ------------------------------------------------------------------------------------------
// Per-block candidate buffers, shared by scan_topk and topk_scores.
//
// Layout of dynamic shared memory: key[QB][BUF] floats, then val[QB][BUF] ints.
// Each query has a count and a threshold: a candidate enters only if its score beats the
// threshold (the k-th best score held once k are held). Before a round would overflow the
// buffer, the block compacts it to its best k. Random data makes compaction rare: after the
// first one the threshold sits in the top fraction of a percent.

template <int QB>
struct Cands {
    float* key; int* val; int* cnt; float* thr; int buf;
    __device__ void offer(int q, float s, int row) {
        if (s > thr[q]) {
            int p = atomicAdd(&cnt[q], 1);
            key[q * buf + p] = s;
            val[q * buf + p] = row;
        }
    }
    // call with all threads, after a __syncthreads, when up to `incoming` may arrive next round;
    // compacts once more than `cap` (<= buf) would be held. A scan uses a cap well below buf (a
    // buffer sized for the merges' rounds): with buf 2048, a block of 1.9k rows (1M rows) never
    // compacted, so its threshold never rose, every row was offered and every block ended with
    // a 2048-entry sort (1M-row graph 470 us instead of 400)
    __device__ void make_room(int k, int incoming, int cap) {
        for (int q = 0; q < QB; q++)
            if (cnt[q] > cap - incoming) compact(key + q * buf, val + q * buf, &cnt[q], &thr[q], k, buf);
    }
};

// Write each query's best k (after a final compact) to scratch or to the outputs.
template <int QB>
__device__ void finish_block(Cands<QB>& c, int k, int nq, float* sk, int* sv, int stride) {
    for (int q = 0; q < QB; q++) {
        compact(c.key + q * c.buf, c.val + q * c.buf, &c.cnt[q], &c.thr[q], k, c.buf);
        if (q < nq)
            for (int i = threadIdx.x; i < k; i += blockDim.x) {
                bool have = i < c.cnt[q];
                sk[q * stride + i] = have ? c.key[q * c.buf + i] : neg_inf();
                sv[q * stride + i] = have ? c.val[q * c.buf + i] : -1;
            }
    }
}

// Block-wide max of kth[l * stride] over the lists (all threads call it).
__device__ float seed_bound(const float* kth, size_t stride, int nlists) {
    __shared__ float red[KALOS_BLOCK / 32];
    float m = neg_inf();
    for (int l = threadIdx.x; l < nlists; l += blockDim.x) m = fmaxf(m, __ldcg(kth + (size_t)l * stride));
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++) m = fmaxf(m, red[w]);
        red[0] = m;
    }
    __syncthreads();
    m = red[0];
    __syncthreads();
    return m;
}

// ---- the global bound and the append lists (scan_topk) ------------------------------------
//
// `sync` (device memory, SYNC_WORDS ints, zero except the bounds) holds per query:
//   ticket[q]  the blocks' "am I last?" counters ([0] here; one per query in topk_scores)
//   bound[q]   the best k-th score any finished block has published, as an ordered int
//   count[q]   entries appended so far to query q's list
// and after them one word: scan_topk's next row to hand out (KALOS_DYNAMIC_ROWS) (it was
// ticket[1], topk_scores' ticket of query 1, until session 11: safe only while launches on
// `sync` never overlapped), then the direction the next scan hands its rows out in
// (KALOS_ALTERNATE: 0 first to last, 1 last to first), then the tag of the next batch-1 scan's
// block heads and lists and how many blocks' heads and lists the area after SYNC_WORDS holds
// (both set by the host: 1 and its largest grid; see ll_merge).
// A block that finishes publishes its k-th score (atomicMax into the bound), then appends its
// entries that reach the bound as it then stands (its list is sorted, so a prefix); see
// append_list for why that loses nothing. Blocks that finish late append little, and the last
// block merges one short list instead of every block's k (which cost several dependent rounds
// of L2 loads). The last block resets count and bound for the next launch.
#define SYNC_WORDS (3 * KALOS_MAXQ + 4)

__device__ __forceinline__ int f2ord(float f) {
    int i = __float_as_int(f);
    return i >= 0 ? i : i ^ 0x7fffffff;
}
__device__ __forceinline__ float ord2f(int i) { return __int_as_float(i >= 0 ? i : i ^ 0x7fffffff); }
__device__ __forceinline__ int* sync_bound(unsigned int* sync) { return reinterpret_cast<int*>(sync) + KALOS_MAXQ; }
__device__ __forceinline__ int* sync_count(unsigned int* sync) { return reinterpret_cast<int*>(sync) + 2 * KALOS_MAXQ; }
// the next row to hand out (KALOS_DYNAMIC_ROWS); the last block puts it back to 0
__device__ __forceinline__ int* sync_rows(unsigned int* sync) { return reinterpret_cast<int*>(sync) + 3 * KALOS_MAXQ; }
// the direction of the next scan's rows (KALOS_ALTERNATE); the last block flips it
__device__ __forceinline__ int* sync_dir(unsigned int* sync) { return reinterpret_cast<int*>(sync) + 3 * KALOS_MAXQ + 1; }
// the tag of the next scan's block lists (ll_merge), never 0; and how many blocks' lists fit
__device__ __forceinline__ unsigned int* sync_tag(unsigned int* sync) { return sync + 3 * KALOS_MAXQ + 2; }
__device__ __forceinline__ unsigned int* sync_ll_cap(unsigned int* sync) { return sync + 3 * KALOS_MAXQ + 3; }
__device__ __forceinline__ float read_bound(unsigned int* sync, int q) {
    return ord2f(*reinterpret_cast<volatile int*>(sync_bound(sync) + q));
}

// The k-th largest (1 <= k <= n) of key[0, n) in shared memory, to every thread of the block.
// A most-significant-digit radix select over the keys' ordered bit patterns: four passes of 8
// bits, each one shared histogram of 256 counters and one warp finding the digit. This replaces
// bitonic sorts of whole lists (log2(n)^2 / 2 block-wide steps: ~80 us for 4096 keys) where
// only one rank is needed. All threads of the block must call it.
__device__ float block_kth_largest(const float* key, int n, int k) {
    __shared__ int hist[256];
    __shared__ unsigned int s_digit;
    __shared__ int s_rank;
    unsigned int prefix = 0u, known = 0u;
    int rank = k;  // rank still wanted among the keys that match the prefix, from the top
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            unsigned int u = (unsigned int)f2ord(key[i]) ^ 0x80000000u;  // ascending as unsigned
            if ((u & known) == prefix) atomicAdd(&hist[(u >> shift) & 255u], 1);
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            const int lane = threadIdx.x;
            int c[8], sum = 0;
#pragma unroll
            for (int j = 0; j < 8; j++) { c[j] = hist[255 - 8 * lane - j]; sum += c[j]; }
            int incl = sum;  // keys with a digit in this lane's range or above
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                int y = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += y;
            }
            int above = incl - sum;
            if (above < rank && rank <= incl) {  // exactly one lane
                int acc = above;
                for (int j = 0; j < 8; j++) {
                    if (acc + c[j] >= rank) { s_digit = 255u - 8u * lane - j; s_rank = rank - acc; break; }
                    acc += c[j];
                }
            }
        }
        __syncthreads();
        prefix |= s_digit << shift;
        known |= 255u << shift;
        rank = s_rank;
        __syncthreads();  // everyone has read s_digit and s_rank before the next pass
    }
    return ord2f((int)(prefix ^ 0x80000000u));
}

// Append this block's sorted list for query q (key/val, n entries) to the global list
// (ak/av + q * cap), keeping only what can still be in the answer. All threads call it.
//
// Why dropping entries below the bound is safe: a block's k-th score is at most the true k-th
// score T (the block alone holds k rows at or above it), so the bound, the best of those, is
// never above T either, and no entry at or above T is ever dropped; the top-k of the list is
// the answer. The block publishes its own k-th first and then appends what reaches the bound
// as it stands: blocks that finish together see each other's k-th, so the list stays short.
__device__ void append_list(const float* key, const int* val, int n, int k, int q,
                            unsigned int* sync, float* ak, int* av, int cap, float* maxima) {
    __shared__ int s_base;
    __shared__ float s_b;
    if (threadIdx.x == 0) {
        if (maxima != nullptr) maxima[blockIdx.x] = n > 0 ? key[0] : neg_inf();  // the list is sorted
        const int mine = n == k ? f2ord(key[k - 1]) : f2ord(neg_inf());
        const int old = atomicMax(sync_bound(sync) + q, mine);
        s_b = ord2f(old > mine ? old : mine);
    }
    __syncthreads();
    const float b = s_b;
    int m = 0;
    for (int base = 0; base < n; base += blockDim.x) {  // the same trip count in every thread
        int i = base + threadIdx.x;
        m += __syncthreads_count(i < n && key[i] >= b);
    }
    if (threadIdx.x == 0) s_base = m ? atomicAdd(sync_count(sync) + q, m) : 0;
    __syncthreads();
    for (int i = threadIdx.x; i < m; i += blockDim.x) {
        ak[(size_t)q * cap + s_base + i] = key[i];
        av[(size_t)q * cap + s_base + i] = val[i];
    }
}

// The k-th largest of the blocks' maxima (one per block, -inf for a block without
// candidates), by warp 0 (the other threads wait at the caller's barrier): k distinct rows
// score at least that much, so the true k-th does too, and it is a bound as valid as the best
// block's k-th and much closer to the answer (the best block's k-th let ~800-1,600 keys
// through to a 4-5 µs select at 1M rows, S9-6). -inf when fewer than k blocks have candidates.
//
// Two ways, by the kernel's storage (maxima_k_max):
// * float rows, k <= 32: the warp takes its largest k times (~3.4 µs at k = 10, S9-7).
// * int8 rows, k <= 128 (its merges take RESCORE_FACTOR x k candidates): a bitwise search over the ordered
//   bit patterns, the largest pattern with at least k maxima at or above it being the k-th
//   largest: 32 rounds of one warp-wide count whatever k is. Without it int8's 40 candidates (4 x k then)
//   had no such bound and their merge took ~40 µs (S10-3); with it ~16 (S11-2). The float
//   kernels keep the loop: built with the search (and int8's early scale load, below) the
//   resident float16 kernel took 5-12 µs longer at 1M rows, though its merge's tail stayed
//   within ~1 µs (S11-2, S11-3: the code around the scan was compiled differently). Their
//   machine code is now the build measured at 370 µs (S11-3), checked with cuobjdump.
__device__ __forceinline__ unsigned int warp_sum(unsigned int v) {
#if __CUDA_ARCH__ >= 800
    return __reduce_add_sync(0xffffffffu, v);
#else
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
#endif
}
__host__ __device__ constexpr int maxima_k_max(bool search) { return search ? 128 : 32; }
static_assert(maxima_k_max(true) <= 32 * MAXIMA_PER_LANE, "the search needs k patterns at or above 0");
template <bool SEARCH, bool REDUX>
__device__ float kth_of_maxima(const float* maxima, int n, int k) {
    const int lane = threadIdx.x & 31;
    if constexpr (SEARCH) {
        unsigned int u[MAXIMA_PER_LANE];  // ascending as unsigned
#pragma unroll
        for (int j = 0; j < MAXIMA_PER_LANE; j++) {
            const int i = j * 32 + lane;
            u[j] = (unsigned int)f2ord(i < n ? __ldcg(maxima + i) : neg_inf()) ^ 0x80000000u;
        }
        unsigned int t = 0u;  // 32 x MAXIMA_PER_LANE >= k patterns are at or above it
#pragma unroll 1
        for (int bit = 31; bit >= 0; bit--) {
            const unsigned int c = t | (1u << bit);
            unsigned int m = 0u;
#pragma unroll
            for (int j = 0; j < MAXIMA_PER_LANE; j++) m += u[j] >= c ? 1u : 0u;
            if (warp_sum(m) >= (unsigned int)k) t = c;  // warp-uniform
        }
        return ord2f((int)(t ^ 0x80000000u));
    } else {
        float v[MAXIMA_PER_LANE];
#pragma unroll
        for (int j = 0; j < MAXIMA_PER_LANE; j++) {
            const int i = j * 32 + lane;
            v[j] = i < n ? __ldcg(maxima + i) : neg_inf();
        }
        float t = neg_inf();
        for (int r = 0; r < k; r++) {  // take the warp's largest k times
            float m = v[0];
            int at = 0;
#pragma unroll
            for (int j = 1; j < MAXIMA_PER_LANE; j++)
                if (v[j] > m) { m = v[j]; at = j; }
            float w;
            unsigned int who;
#if __CUDA_ARCH__ >= 800
            if (REDUX) {
                // the warp's largest in one instruction on the ordered bit patterns, not five
                // dependent shuffles (S20-2: batch 1's scan + merge -0.3 to -0.4 µs at 100k
                // rows). A NaN m (a lane whose first maximum is NaN) counts as -inf, as
                // fmaxf ignores it; -0 and +0 differ here and not there, which moves no
                // bound: the two compare equal where the bound is used.
                const int mo = m == m ? f2ord(m) : f2ord(neg_inf());
                const int wo = __reduce_max_sync(0xffffffffu, mo);
                w = ord2f(wo);
                who = __ballot_sync(0xffffffffu, mo == wo);
            } else
#endif
            {
                w = m;
                for (int o = 16; o > 0; o >>= 1) w = fmaxf(w, __shfl_xor_sync(0xffffffffu, w, o));
                who = __ballot_sync(0xffffffffu, m == w);
            }
            if (lane == __ffs(who) - 1) {  // one lane gives up its largest
#pragma unroll
                for (int j = 0; j < MAXIMA_PER_LANE; j++)
                    if (j == at) v[j] = neg_inf();
            }
            t = w;
        }
        return t;
    }
}

// The last block: merge query q's appended list, write the answer, reset q's words.
// SEARCH: how kth_of_maxima finds its bound.
template <int QB, bool SEARCH>
__device__ void merge_appended(Cands<QB>& c, const Params* p, int q, int k, unsigned int* sync,
                               const float* ak, const int* av, int cap, const float* maxima) {
    __shared__ float s_b2;
    float bound = read_bound(sync, q);
    const int total = *reinterpret_cast<volatile int*>(sync_count(sync) + q);
    if (threadIdx.x == 0) { c.cnt[q] = 0; c.thr[q] = neg_inf(); }
    if (maxima != nullptr && threadIdx.x < 32) {  // block-uniform condition
        const float b2 = kth_of_maxima<SEARCH, QB == 1 && KALOS_MAXIMA_REDUX>(maxima, gridDim.x, k);
        if (threadIdx.x == 0) s_b2 = b2;
    }
    __syncthreads();
    if (maxima != nullptr) bound = fmaxf(bound, s_b2);
    KALOS_STAMP(3);
    KALOS_COUNT(8, total);
    const float* sk = ak + (size_t)q * cap;
    const int* sv = av + (size_t)q * cap;
    // Not a sort of the whole list: (1) what reaches the final bound goes to shared memory, in
    // rounds of independent L2 loads; (2) if that is still long, its k-th by radix select in
    // shared memory; (3) what reaches the k-th (k plus ties) goes back out through the list's
    // own storage, already read, and returns as the only entries to sort. Sorting every
    // survivor of (1) (a 1-2k entry bitonic sort) was most of the scan's fixed cost at 100k.
    // More survivors than the buffer holds: the rounds below, which compact as they go.
    float* key = c.key + q * c.buf;
    int* val = c.val + q * c.buf;
    int from = 0;  // where the rounds below start: past the end once (1) took the list
    if (total > 2 * k) {  // block-uniform
        for (int base = 0; base < total; base += MERGE_UNROLL * blockDim.x) {
            float s[MERGE_UNROLL];
            int r[MERGE_UNROLL];
#pragma unroll
            for (int u = 0; u < MERGE_UNROLL; u++) {  // independent loads, all in flight at once
                int i = base + u * blockDim.x + threadIdx.x;
                r[u] = -1;
                if (i < total) { s[u] = __ldcg(sk + i); r[u] = __ldcg(sv + i); }
            }
#pragma unroll
            for (int u = 0; u < MERGE_UNROLL; u++) {
                if (r[u] >= 0 && s[u] >= bound) {
                    const int at = atomicAdd(&c.cnt[q], 1);
                    if (at < c.buf) { key[at] = s[u]; val[at] = r[u]; }
                }
            }
        }
        __syncthreads();
        const int m = c.cnt[q];
        KALOS_STAMP(4);
        KALOS_COUNT(9, m);
        if (m <= c.buf) {
            from = total;
            if (m > 2 * k && m > 64) {
                const float t = block_kth_largest(key, m, k);
                __shared__ int s_g;
                if (threadIdx.x == 0) s_g = 0;
                __syncthreads();
                float* gk = const_cast<float*>(sk);  // the list, read in full above
                int* gv = const_cast<int*>(sv);
                for (int i = threadIdx.x; i < m; i += blockDim.x) {
                    if (key[i] >= t) {
                        const int at = atomicAdd(&s_g, 1);
                        gk[at] = key[i];
                        gv[at] = val[i];
                    }
                }
                __syncthreads();  // the block's global writes are visible to the block after it
                const int g = s_g;
                for (int i = threadIdx.x; i < g; i += blockDim.x) { key[i] = __ldcg(gk + i); val[i] = __ldcg(gv + i); }
                if (threadIdx.x == 0) c.cnt[q] = g;
                __syncthreads();
            }
        } else {
            __syncthreads();
            if (threadIdx.x == 0) c.cnt[q] = 0;
            __syncthreads();
        }
    }
    for (int base = from; base < total; base += MERGE_UNROLL * blockDim.x) {
        float s[MERGE_UNROLL];
        int r[MERGE_UNROLL];
#pragma unroll
        for (int u = 0; u < MERGE_UNROLL; u++) {  // independent loads, all in flight at once
            int i = base + u * blockDim.x + threadIdx.x;
            r[u] = -1;
            if (i < total) { s[u] = __ldcg(sk + i); r[u] = __ldcg(sv + i); }
        }
#pragma unroll
        for (int u = 0; u < MERGE_UNROLL; u++)
            if (r[u] >= 0 && s[u] >= bound) c.offer(q, s[u], r[u]);
        __syncthreads();
        if (c.cnt[q] > c.buf - MERGE_UNROLL * (int)blockDim.x)
            compact(c.key + q * c.buf, c.val + q * c.buf, &c.cnt[q], &c.thr[q], k, c.buf);
    }
    KALOS_STAMP(5);
    KALOS_COUNT(10, c.cnt[q]);
    compact_top<!SEARCH>(c.key + q * c.buf, c.val + q * c.buf, &c.cnt[q], &c.thr[q], k, c.buf);
    KALOS_STAMP(6);
    int* orow = p->out_rows[q];
    float* oscore = p->out_scores[q];
    for (int i = threadIdx.x; i < k; i += blockDim.x) {
        bool have = i < c.cnt[q];
        orow[i] = have ? c.val[q * c.buf + i] : -1;
        oscore[i] = have ? c.key[q * c.buf + i] : neg_inf();
    }
    if (threadIdx.x == 0) {
        sync_count(sync)[q] = 0;
        sync_bound(sync)[q] = f2ord(neg_inf());
    }
    KALOS_STAMP(7);
}

// Block-wide "am I the last block?" after this block's scratch writes. Resets the counter.
__device__ bool last_block(unsigned int* counter) {
    __shared__ bool is_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int ticket = atomicAdd(counter, 1u);
        is_last = (ticket == gridDim.x * gridDim.y - 1);
        if (is_last) *counter = 0;  // ready for the next launch
    }
    __syncthreads();
    if (is_last) __threadfence();
    return is_last;
}

__device__ __forceinline__ void final_fence() {
    // results went to host memory: make them visible before the stream reports completion
    __threadfence_system();
}

// ---- batch 1: the blocks' lists, tagged, merged by block 0 (KALOS_LL_MERGE) ---------------
//
// The appended lists above put four dependent L2 round trips on the answer's path after the
// last block's scan: the bound's atomicMax, the count's atomicAdd, the fence and ticket of the
// election, then the merging block's reads of the bound, the count and the maxima, each a
// round trip, before its first pass over the list (merge_stamps.py, S22-3: ~10.8 µs from the
// merging block's loop end to its answer at 100k rows, of which ~6 µs those round trips).
// Batch-1 scans with k <= LL_K_MAX instead do this:
//   * every block but 0 writes its best k, sorted, as its own list of tagged records (16 bytes
//     per entry: {score bits, tag}, {row, tag}; padding (-inf, INT_MAX) past its count), with
//     no atomic, no fence and no count: a reader that sees the scan's tag in both halves of an
//     entry has it (see "Tagged records" at the top). Its head (the list's best; its entry 0
//     holds the same bits) is written first, to its own place among the heads (ll_head_at),
//     before the selection of the rest (ll_head, ll_publish);
//   * block 0 writes only its head; it reads every head, picks the k-th best head B
//     (compact_top; in two rounds, the heads already written and then the late ones at or
//     above the first round's k-th, see ll_merge), and then reads only the lists whose head is
//     at or above B: there are at most k of them, since a row of any other list is below its
//     head, which is below k heads, so it is not in the answer. Of those lists' k x k entries,
//     those at or above B go to the final selection (at least the k heads); block 0's own best
//     k come from its candidates, selected only when its head is at or above B (~k/G scans).
// So the answer waits for the last block's head, not its list (unless that list is one of
// the k), and block 0's own selection is off the path in most scans: the tail at 100k, grid
// 396, 7.14 -> 5.52 µs (merge_stamps.py, S24-1 / S24-3).
// The order is compact_top's (score descending, ties by row ascending); rows are unique across
// lists (each row is scanned by one block), so the order is total. Fewer than k real heads: B
// is padding, and every list with a real head is read.
//
// The tag is the word sync_tag, which the host sets to 1 and block 0 moves on (skipping 0) once
// it has read every head and the lists it needs; every block reads it as its scan starts, which
// is before its head, which block 0 reads before moving it: each scan's records carry their own
// tag. Block 0 clears the heads it read, and when the tag wraps the whole area, so a record an
// earlier cycle left cannot carry a tag of the next. (A block's list may still be being written
// after block 0 moved the tag, when it is not one of the k: those records carry the old tag,
// and lie in the block's own LL_K_MAX entries, ll_list, which its next scan rewrites in program
// order after them; such a record, if that block then rewrote no list entry that far (no scan
// with as large a k that included it) for a whole cycle of 2^32 - 1 scans, is the one stale
// record a tag could match, and only if block 0 read it before the block rewrote it.) A scan
// that never finishes leaves the tag where it was; on this GPU only the loss of the context
// does that, and with it the memory. k must be at least 1 (the caller's condition): with none,
// no block would write a head and block 0 would wait for ever.
// Block 0 waits for the other blocks (they never wait): a launch finishes as long as one other
// block can be resident beside it, which the graphs' and the resident kernel's grids allow on a
// GPU of their own.
// The area after SYNC_WORDS holds a head and LL_K_MAX entries per block for sync_ll_cap blocks
// (the host's largest grid; ll_heads, ll_list); a grid above it, above 2 x KALOS_BLOCK (two
// keys per thread: the selection's) or one whose heads do not fit in block 0's candidate buffer beside its candidates (scan_cap + G +
// k <= buf / 2; G copied in the second half) takes the appended lists: the graphs' batch-1 scans
// at 4 blocks per SM (528 on an H200) do. KALOS_LL_MERGE=0 builds the appended lists only,
// KALOS_LL_ROUNDS=0 the k-th head in one round (for A/B runs).
#ifndef KALOS_LL_MERGE
#define KALOS_LL_MERGE 1
#endif
#ifndef KALOS_LL_ROUNDS
#define KALOS_LL_ROUNDS 1
#endif
#define LL_K_MAX 32             // largest k of the tagged merge (the selection's)
#define LL_WORDS_PER_BLOCK (4 * LL_K_MAX + 4)  // a list and a head

// The area after SYNC_WORDS: cap heads of 16 bytes, one per block, side by side (block 0 reads
// a warp's 32 heads from 512 contiguous bytes: five 128-byte lines, the area starting 16 bytes
// past a line), then cap lists of LL_K_MAX entries.
__device__ __forceinline__ u64* ll_heads(unsigned int* sync) { return reinterpret_cast<u64*>(sync + SYNC_WORDS); }
__device__ __forceinline__ u64* ll_head_at(u64* heads, int b) { return heads + 2 * b; }
// Block b's list: LL_K_MAX entries of its own whatever this scan's k, so that a block still
// writing the rest of its list after block 0 answered (its head is all block 0 waits for, and
// the resident kernel's next request may have another k) writes only where it alone writes.
__device__ __forceinline__ u64* ll_list(u64* heads, unsigned int cap, int b) {
    return heads + (size_t)2 * cap + (size_t)2 * LL_K_MAX * b;
}
// (score, row) a before b in the answer's order (scores as sel_ord patterns)
__device__ __forceinline__ bool ll_before(int oa, int ra, int ob, int rb) { return oa > ob || (oa == ob && ra < rb); }

// A block's head: the best of its candidates (sel_pack's order, padding for a block with no
// rows), written to its place among the heads (ll_head_at) from a max over the candidates (a warp
// reduction and one barrier). All threads call it.
template <int QB>
__device__ void ll_head(Cands<QB>& c, u64* mine, u64 t) {
    __shared__ u64 s_wbest[KALOS_BLOCK / 32];
    const int n0 = c.cnt[0];
    u64 h = sel_pack(neg_inf(), 0x7fffffff);
    for (int i = threadIdx.x; i < n0; i += blockDim.x) h = max64(h, sel_pack(c.key[i], c.val[i]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) h = max64(h, __shfl_xor_sync(0xffffffffu, h, o));
    if ((threadIdx.x & 31) == 0) s_wbest[threadIdx.x >> 5] = h;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++) h = max64(h, s_wbest[w]);
        vstore128(mine, t | __float_as_uint(sel_pack_key(h)), t | (unsigned int)sel_pack_val(h));
#ifdef KALOS_STAMPS
        unsigned long long t_head;
        KALOS_T(t_head);
        atomicMax(&kalos_stamps[16], t_head);
#endif
    }
}

// Every block but 0: its head, and its best k, sorted, as list blockIdx.x (2k u64 from
// ll_list). With KALOS_LL_HEAD_FIRST the head is written first (ll_head) and the list after the
// selection: block 0 needs every head to pick the k-th, but the last block's list only in the
// ~k/G scans where its head reaches it, so the last block's compaction (~2.2 µs, S24-2) leaves
// the answer's path. The head is the selection's first entry (the same order), so the list's
// entry 0 holds the same bits. All threads call it.
#ifndef KALOS_LL_HEAD_FIRST
#define KALOS_LL_HEAD_FIRST 1
#endif
template <int QB>
__device__ void ll_publish(Cands<QB>& c, int k, u64* heads, unsigned int cap, unsigned int tag) {
    const u64 t = (u64)tag << 32;
    u64* mine = ll_list(heads, cap, blockIdx.x);
    if (KALOS_LL_HEAD_FIRST) ll_head(c, ll_head_at(heads, blockIdx.x), t);
    compact_top<true>(c.key, c.val, &c.cnt[0], &c.thr[0], k, c.buf);
    const int n = c.cnt[0];
    for (int i = threadIdx.x; i < k; i += blockDim.x) {
        const bool have = i < n;
        const u64 a = t | __float_as_uint(have ? c.key[i] : neg_inf()), b = t | (unsigned int)(have ? c.val[i] : 0x7fffffff);
        vstore128(mine + 2 * i, a, b);
        if (!KALOS_LL_HEAD_FIRST && i == 0) vstore128(ll_head_at(heads, blockIdx.x), a, b);
    }
}

// Block 0, after its scan: the answer from its own candidates and every other block's list,
// into the outputs and, sorted, into c.key / c.val (the resident kernel reads the rows there);
// returns how many results. Block 0 writes only its head (ll_head): its own best k are
// selected only when its head reaches the k-th head B (~k/G of scans), and then taken from
// its candidate buffer, not through memory. Its candidates (at most `cands` of them) stay in
// key/val [0, cands) until then; the heads are selected at [cands, cands + G + k) and copied
// at [half, half + G) (the caller's condition: cands + G + k <= half). All threads call it.
template <int QB>
__device__ int ll_merge(Cands<QB>& c, const Params* p, int k, unsigned int* sync, unsigned int cap, unsigned int tag,
                        int cands) {
    // heads (then the selection's count), the second round's keys, lists to read, entries,
    // whether block 0's own best are needed
    __shared__ int s_nh, s_n2, s_nc, s_ns, s_own;
    __shared__ float s_hthr;  // (the heads' selections' threshold: not used)
    __shared__ int s_cl[LL_K_MAX];
    u64* heads = ll_heads(sync);
    const int G = gridDim.x;
    ll_head(c, ll_head_at(heads, 0), (u64)tag << 32);
    KALOS_STAMP(1);
    float* key = c.key;
    int* val = c.val;
    float* hkey = key + cands;  // the heads' selections
    int* hval = val + cands;
    // The heads, in two rounds (KALOS_LL_ROUNDS). First, block 0 reads every head once, those
    // not written yet standing as padding (heads into hkey/hval [0, G) for the selection, a
    // copy at key/val [half, half + G) for the lists' test below), and selects the k-th of those
    // in, P. P is a bound: a head that comes later and is below P is below k heads, so not among
    // the k best. Then each thread waits for its missing heads (at most two: G <= 2 x
    // blockDim.x) and adds those at or above P to the first round's k for a second selection,
    // of a few keys. So the selection over up to G keys (~2.2 µs at 396, S24-3) runs while the
    // last blocks scan, and the last head costs the small one (~1.1 µs). (S24-2, S24-3: waiting
    // for most heads before the first round, or block 0 asking for no more rows near the end
    // so that it is at its merge earlier, gained nothing measurable; docs/experiments/.) Thread
    // t reads lists t and t + blockDim.x one at a time: with two loads in flight per thread (or
    // the heads held in registers through the selection, or a selection of four keys per lane)
    // the resident float16 kernel, capped at 80 registers, spilled 12-324 bytes (nvcc 13, sm_90).
    const int half = c.buf / 2;
    const int w = threadIdx.x >> 5;
    __shared__ int s_in[2][KALOS_BLOCK / 32];
    unsigned int missing = 0;  // bit j: list threadIdx.x + j x blockDim.x, its head not read yet
#pragma unroll
    for (int j = 0; j < 2; j++) {
        const int b = threadIdx.x + j * blockDim.x;
        if (b < G) {  // padding until read
            hkey[b] = key[half + b] = neg_inf();
            hval[b] = val[half + b] = 0x7fffffff;
            missing |= 1u << j;
        }
    }
    if (threadIdx.x == 0) { s_nh = G; s_n2 = min(G, k); s_nc = 0; s_ns = 0; s_own = 0; }
    // the first round: one read of each head (without KALOS_LL_ROUNDS: polls, one barrier
    // each, until every head is in)
    const int late_ok = KALOS_LL_ROUNDS ? G : 0;
    int arrived = 0;
    for (int it = 0;; it++) {
        int in = 0;  // heads this warp read in this poll
#pragma unroll
        for (int j = 0; j < 2; j++) {
            bool got = false;
            if (missing >> j & 1u) {
                const int b = threadIdx.x + j * blockDim.x;
                const ulonglong2 h = vload128(ll_head_at(heads, b));
                got = tagged(h, tag);
                if (got) {
                    hkey[b] = key[half + b] = __uint_as_float((unsigned int)h.x);
                    hval[b] = val[half + b] = (int)(unsigned int)h.y;
                    missing &= ~(1u << j);
                }
            }
            in += __popc(__ballot_sync(0xffffffffu, got));
        }
        if ((threadIdx.x & 31) == 0) s_in[it & 1][w] = in;  // (double-buffered: one barrier per poll)
        __syncthreads();
        for (int i = 0; i < (int)(blockDim.x >> 5); i++) arrived += s_in[it & 1][i];
        if (G - arrived <= late_ok) break;  // block-uniform
    }
    KALOS_STAMP(2);
    KALOS_COUNT(17, G - arrived);
    // the k-th head (of those in); with fewer than k, padding (every list with a real head is
    // read, and all of its entries pass). G <= 2 x blockDim.x: the selection applies (the
    // caller's condition)
    compact_top<true>(hkey, hval, &s_nh, &s_hthr, k, half - cands);
    int* nh = &s_nh;
    if (arrived < G) {  // block-uniform: the second round
        KALOS_STAMP(5);
        const bool full1 = s_nh == k;
        const int po = full1 ? sel_ord(hkey[k - 1]) : sel_ord(neg_inf()), pr = full1 ? hval[k - 1] : 0x7fffffff;
#pragma unroll
        for (int j = 0; j < 2; j++) {
            if (!(missing >> j & 1u)) continue;
            const int b = threadIdx.x + j * blockDim.x;
            ulonglong2 h;
            do { h = vload128(ll_head_at(heads, b)); } while (!tagged(h, tag));
            const float s = __uint_as_float((unsigned int)h.x);
            const int r = (int)(unsigned int)h.y;
            key[half + b] = s;
            val[half + b] = r;
            if (r != 0x7fffffff && !ll_before(po, pr, sel_ord(s), r)) {  // at or above P
                const int a = atomicAdd(&s_n2, 1);  // after the first round's min(G, k)
                hkey[a] = s;
                hval[a] = r;
            }
        }
        __syncthreads();
        KALOS_STAMP(11);
        compact_top<true>(hkey, hval, &s_n2, &s_hthr, k, half - cands);
        nh = &s_n2;
    }
    // B, the k-th head (padding: fewer than k real heads)
    const bool full = *nh == k;
    const int bo = full ? sel_ord(hkey[k - 1]) : sel_ord(neg_inf()), br = full ? hval[k - 1] : 0x7fffffff;
    KALOS_STAMP(3);
    // the lists to read: those whose head is at or above B (at most k), block 0's own apart
    for (int b = threadIdx.x; b < G; b += blockDim.x) {
        const int r = val[half + b];
        if (r != 0x7fffffff && !ll_before(bo, br, sel_ord(key[half + b]), r)) {
            if (b == 0) {
                s_own = 1;
            } else {
                const int at = atomicAdd(&s_nc, 1);
                if (at < LL_K_MAX) s_cl[at] = b;
            }
        }
    }
    __syncthreads();  // the lists to read are known, and everyone has B before key/val change
    if (s_own) {  // block-uniform: block 0's best k, sorted into [0, k); those at or above B
        // (a prefix) stay there, the other lists' entries go after them
        compact_top<true>(key, val, &c.cnt[0], &c.thr[0], k, cands);
        for (int i = threadIdx.x; i < c.cnt[0]; i += blockDim.x)
            if (!ll_before(bo, br, sel_ord(key[i]), val[i])) atomicAdd(&s_ns, 1);
        __syncthreads();
    }
    const int nc = min(s_nc, LL_K_MAX);
    const int total = nc * k;  // entries of those lists: at most k x k
    for (int i = threadIdx.x; i < total; i += blockDim.x) {
        const int j = i / k;
        const u64* at = ll_list(heads, cap, s_cl[j]) + 2 * (i - j * k);
        ulonglong2 e;
        do { e = vload128(at); } while (!tagged(e, tag));
        const float s = __uint_as_float((unsigned int)e.x);
        const int r = (int)(unsigned int)e.y;
        if (r != 0x7fffffff && !ll_before(bo, br, sel_ord(s), r)) {
            const int a2 = atomicAdd(&s_ns, 1);
            key[a2] = s;
            val[a2] = r;
        }
    }
    __syncthreads();
    KALOS_STAMP(4);
    KALOS_COUNT(8, nc + s_own);
    KALOS_COUNT(9, s_ns);
    compact_top<true>(key, val, &s_ns, &c.thr[0], k, c.buf);  // (above 2 x blockDim.x: a sort)
    const int n = s_ns;
    KALOS_STAMP(6);
    KALOS_COUNT(10, n);
    int* orow = p->out_rows[0];
    float* oscore = p->out_scores[0];
    for (int i = threadIdx.x; i < k; i += blockDim.x) {
        const bool have = i < n;
        orow[i] = have ? val[i] : -1;
        oscore[i] = have ? key[i] : neg_inf();
    }
    // every list is read: clear the heads, and the next scan's tag. When the tag wraps, the
    // whole area is cleared first (once in 2^32 - 1 scans), so that no record an earlier scan
    // left in a list (or a head beyond this grid) carries the next cycle's tags
    if (tag + 1u) {
        for (int b = threadIdx.x; b < G; b += blockDim.x) vstore128(ll_head_at(heads, b), 0ull, 0ull);
    } else {
        for (int i = threadIdx.x; i < (int)cap * (LL_WORDS_PER_BLOCK / 4); i += blockDim.x) vstore128(heads + 2 * i, 0ull, 0ull);
        __syncthreads();
    }
    if (threadIdx.x == 0) *sync_tag(sync) = tag + 1u ? tag + 1u : 1u;
    KALOS_STAMP(7);
    return n;
}

// ------------------------------------------------------------------------------------------
// scan_topk<T, TPR, QB, METRIC>: fused scan + top-k for up to QB queries.
//   grid: (G), block: KALOS_BLOCK; dynamic shared memory: QB*ld floats + QB*buf*(4+4) bytes.
//   TPR threads score one row together (each 16-byte chunk c of the row goes to lane c % TPR);
//   rows are spread over blocks and groups with a grid stride.

// The body, shared with doorbell_topk (which runs it once per request): returns, in the
// merging block only (block 0 for the tagged lists, the last block to finish for the appended
// ones; after it wrote the answer), how many results query 0 has; -1 elsewhere. The
// queries are read through L2 (__ldcg): the resident kernel rewrites them between requests.
// LIST: which rows the scan walks. SCAN_MASK: rows 0 .. n_rows - 1 of the namespace and mask;
// SCAN_LIST: the n_rows rows of the list `mask` points to (ns_id NS_LIST); SCAN_EITHER: one or
// the other as ns_id says, decided per request (one scan body where the two modes would
// compile two: the resident kernel's build that serves lists).
#define SCAN_MASK 0
#define SCAN_LIST 1
#define SCAN_EITHER 2
template <typename T, int TPR, int QB, int METRIC, int LIST = SCAN_MASK>
__device__ int scan_body(const T* __restrict__ data, const int* __restrict__ ns, const float* __restrict__ sqnorm,
                         const float* __restrict__ rowscale, const Params* p,
                         const float* qbuf, const signed char* qbuf_i8, int ld, int buf,
                         float* __restrict__ scratch_k, int* __restrict__ scratch_v,
                         unsigned int* __restrict__ sync, float* smem) {
    __shared__ int s_cnt[QB];
    __shared__ float s_thr[QB];
    constexpr int V = Vec<T>::N;
    const int chunks = ld / V;                    // 16-byte chunks per row
    float* sq = smem;                             // queries [QB][ld]
    Cands<QB> c{sq + QB * ld, reinterpret_cast<int*>(sq + QB * ld + QB * buf), s_cnt, s_thr, buf};

    const int nq = p->n_queries, k = p->k, n = p->n_rows, my_ns = p->ns_id;
    const unsigned char* mask = p->mask;
    if (Vec<T>::INT8) {  // int8 queries as bytes at the start of each query's row
        unsigned char* sb = reinterpret_cast<unsigned char*>(sq);
        for (int i = threadIdx.x; i < QB * ld; i += blockDim.x)
            sb[(size_t)(i / ld) * ld * 4 + i % ld] = (i / ld) < nq ? (unsigned char)__ldcg(qbuf_i8 + i) : 0;
    } else {
        for (int i = threadIdx.x; i < QB * ld; i += blockDim.x) sq[i] = (i / ld) < nq ? __ldcg(qbuf + i) : 0.f;
    }
    if (threadIdx.x < QB) { s_cnt[threadIdx.x] = 0; s_thr[threadIdx.x] = neg_inf(); }
    // batch 1 (QB = 1), float rows, k <= LL_K_MAX: the tagged lists and block 0's merge
    // (ll_merge); the lists' tag and the area's size, read as the scan starts
    constexpr bool ll_build = KALOS_LL_MERGE && QB == 1 && !Vec<T>::INT8 &&
                              !(KALOS_PROBE & (PROBE_NO_TAIL | PROBE_NO_APPEND | PROBE_NO_MERGE));
    __shared__ unsigned int s_ll[2];
    if (ll_build && threadIdx.x == 32) {
        s_ll[0] = *reinterpret_cast<volatile unsigned int*>(sync_tag(sync));
        s_ll[1] = *reinterpret_cast<volatile unsigned int*>(sync_ll_cap(sync));
    }
    __syncthreads();
    if (KALOS_PROBE & PROBE_EMPTY) return -1;

    const int lane = threadIdx.x % TPR;
    const int group = threadIdx.x / TPR;
    const int groups = KALOS_BLOCK / TPR;
    const int stride = gridDim.x * groups;
    int scan_cap = next_pow2(k + KALOS_BLOCK);  // k plus a block's worth of offers
    if (scan_cap > buf) scan_cap = buf;
    const uint4* base = reinterpret_cast<const uint4*>(data);
    // Rows by the round: with KALOS_DYNAMIC_ROWS, thread 0 asks the counter for the next round's
    // rows as a round begins (the atomic's latency hides behind the round's loads) and passes
    // them on through s_next, double-buffered: a slow thread may still read one entry while
    // thread 0 writes the other. (Probes that skip the last block never reset the counter.)
    constexpr bool dynamic = KALOS_DYNAMIC_ROWS && !(KALOS_PROBE & (PROBE_NO_TAIL | PROBE_NO_APPEND));
    // With KALOS_ALTERNATE, on every other scan the counter's r-th row is row n - 1 - r. Every
    // block reads the flag before it takes part in the election of the last block, which flips
    // it, so all of one scan's blocks agree on the direction.
    __shared__ int s_next[2];
    __shared__ int s_dir;
    int* next_row = sync_rows(sync);
    int r0 = blockIdx.x * groups;
    bool rev = false;
    if (dynamic) {
        if (threadIdx.x == 0) {
            s_next[0] = atomicAdd(next_row, groups);
            if (KALOS_ALTERNATE) s_dir = *reinterpret_cast<volatile int*>(sync_dir(sync));
        }
        __syncthreads();
        r0 = s_next[0];
        rev = KALOS_ALTERNATE && s_dir != 0;
    }
    for (int round = 1; r0 < n; round++) {
        int ahead = 0;
        if (dynamic && threadIdx.x == 0) ahead = atomicAdd(next_row, groups);
        const int r = r0 + group;
        int row = rev ? n - 1 - r : r;
        bool ok;
        if (LIST == SCAN_LIST || (LIST == SCAN_EITHER && my_ns == NS_LIST)) {  // `mask` is the list of the rows
            ok = r < n;
            if (ok) row = __ldg(reinterpret_cast<const int*>(mask) + row);
        } else {
            ok = (KALOS_PROBE & PROBE_NO_NS)
                     ? r < n
                     : r < n && (my_ns == NS_ANY || ns[row] == my_ns) && (mask == nullptr || mask[row]);
        }
        float acc[QB];
#pragma unroll
        for (int q = 0; q < QB; q++) acc[q] = 0.f;
        // int8: the row's scale, loaded before its bytes so that its latency hides behind
        // theirs rather than following the dot product (as in the int8 build measured at
        // 244 µs in S11-3; its share alone was not isolated). Float rows: code unchanged.
        float rs = 1.f;
        if constexpr (Vec<T>::INT8) {
            if (ok && lane == 0) rs = __ldg(rowscale + row);
        }
        if (ok) {
            // all of a thread's loads for up to UNROLL chunks are in flight before the first use
            // 8, not 16: 16 loads in flight per thread cost registers, hence blocks per SM
            // (H200, 1M rows: 482 us at 16, 399-468 us at 8)
            constexpr bool split = QB == 1 && (Vec<T>::INT8 ? KALOS_SCAN_SPLIT_I8 : KALOS_SCAN_SPLIT_F);
            constexpr int UNROLL = !Vec<T>::INT8 ? 8 : split ? KALOS_UNROLL_I8_SPLIT : KALOS_UNROLL_I8;
            const uint4* rp = base + (size_t)row * chunks;
            int ch0 = lane;
            if constexpr (split) {
                // whole spans of UNROLL chunks first, with no per-chunk bounds check: every chunk's
                // product is then straight-line code the compiler can interleave (with the checks,
                // each chunk was its own branch region: its shared load, dot and add ran one after
                // another); int8 sums its products as ints (exact: |sum| <= 127 * 127 * dim, below
                // 2^31 for any dim under 133,000) and converts once per row. The tail, below, is
                // checked as before. int8's resident kernel: 128 registers and no spill with 6 loads
                // and 2 blocks per SM (185 registers without the bound: one block per SM).
                int acc_i[QB];
#pragma unroll
                for (int q = 0; q < QB; q++) acc_i[q] = 0;
                for (; ch0 + (UNROLL - 1) * TPR < chunks; ch0 += UNROLL * TPR) {
                    uint4 v[UNROLL];
#pragma unroll
                    for (int u = 0; u < UNROLL; u++) v[u] = ld_row<Vec<T>::INT8 ? KALOS_L2PF_I8 : KALOS_L2PF_F>(rp + ch0 + u * TPR);
#pragma unroll
                    for (int u = 0; u < UNROLL; u++) {
#pragma unroll
                        for (int q = 0; q < QB; q++) {
                            if constexpr (Vec<T>::INT8) acc_i[q] += Vec<T>::dot_i(v[u], sq + q * ld, ch0 + u * TPR);
                            else acc[q] += Vec<T>::dot(v[u], sq + q * ld, ch0 + u * TPR);
                        }
                    }
                }
                if constexpr (Vec<T>::INT8) {
#pragma unroll
                    for (int q = 0; q < QB; q++) acc[q] = (float)acc_i[q];
                }
            }
            for (; ch0 < chunks; ch0 += UNROLL * TPR) {
                uint4 v[UNROLL];
#pragma unroll
                for (int u = 0; u < UNROLL; u++) {
                    int ch = ch0 + u * TPR;
                    if (ch < chunks) v[u] = ld_row<Vec<T>::INT8 ? KALOS_L2PF_I8 : KALOS_L2PF_F>(rp + ch);
                }
#pragma unroll
                for (int u = 0; u < UNROLL; u++) {
                    int ch = ch0 + u * TPR;
                    if (ch < chunks) {
#pragma unroll
                        for (int q = 0; q < QB; q++) acc[q] += Vec<T>::dot(v[u], sq + q * ld, ch);
                    }
                }
            }
        }
#pragma unroll
        for (int q = 0; q < QB; q++) {
#pragma unroll
            for (int o = TPR / 2; o > 0; o >>= 1) acc[q] += __shfl_xor_sync(0xffffffff, acc[q], o);
        }
        if (ok && lane == 0) {
#pragma unroll
            for (int q = 0; q < QB; q++) {
                if (q >= nq) break;
                float s = acc[q];
                if (rowscale != nullptr) s *= (Vec<T>::INT8 ? rs : rowscale[row]) * p->qscale[q];
                if (METRIC == METRIC_L2) s = -sqrtf(fmaxf(p->qnorm2[q] + sqnorm[row] - 2.f * s, 0.f));
                if (!(KALOS_PROBE & PROBE_NO_OFFERS) || s > 1e30f) c.offer(q, s, row);  // keeps the loads live
            }
        }
        if (dynamic && threadIdx.x == 0) s_next[round & 1] = ahead;
        if (dynamic || !(KALOS_PROBE & PROBE_NO_SYNC)) __syncthreads();
        if (!(KALOS_PROBE & PROBE_NO_OFFERS)) c.make_room(k, groups, scan_cap);
        r0 = dynamic ? s_next[round & 1] : r0 + stride;
    }
#ifdef KALOS_STAMPS
    unsigned long long t_loop, t_append;
    KALOS_T(t_loop);
    if (threadIdx.x == 0) { atomicMin(&kalos_stamps[12], t_loop); atomicMax(&kalos_stamps[13], t_loop); }
#endif
    if (KALOS_PROBE & PROBE_NO_TAIL) return -1;
    if constexpr (ll_build) {
        const unsigned int tag = s_ll[0];
        const int G = gridDim.x;
        if (tag != 0u && k > 0 && k <= LL_K_MAX && G <= (int)s_ll[1] && G <= 2 * (int)blockDim.x &&
            scan_cap + G + k <= buf / 2 && k * k <= buf / 2) {
            if (blockIdx.x != 0) {
                ll_publish(c, k, ll_heads(sync), s_ll[1], tag);
#ifdef KALOS_STAMPS
                KALOS_T(t_append);
                if (threadIdx.x == 0) atomicMax(&kalos_stamps[14], t_append);
#endif
                return -1;
            }
#ifdef KALOS_STAMPS
            if (threadIdx.x == 0) { kalos_stamps[0] = t_loop; kalos_stamps[15] = 1; }
#endif
            const int got = ll_merge(c, p, k, sync, s_ll[1], tag, scan_cap);
            if (dynamic && threadIdx.x == 0) {  // every block is past its scan: ready for the next
                *next_row = 0;
                if (KALOS_ALTERNATE) *sync_dir(sync) = !rev;
            }
            return got;
        }
    }
    // this block's best k per query -> the appended lists; the last block merges them
    const int cap = gridDim.x * k;
    // each block's best score per query, after the lists (QB * cap entries): a second bound
    // for the merge (kth_of_maxima), for k <= maxima_k_max and grids a warp's registers hold.
    // The host sizes scratch_k for FUSED_MAX_Q x max_grid x 1024 entries: QB * grid * (k + 1)
    // fits.
    constexpr bool search = Vec<T>::INT8;
    float* maxima = (k <= maxima_k_max(search) && (int)gridDim.x <= 32 * MAXIMA_PER_LANE) ? scratch_k + (size_t)QB * cap
                                                                                          : nullptr;
    for (int q = 0; q < QB; q++) {
        compact_top<!search>(c.key + q * c.buf, c.val + q * c.buf, &c.cnt[q], &c.thr[q], k, c.buf);
        if (KALOS_PROBE & PROBE_NO_APPEND) continue;
        if (q < nq) append_list(c.key + q * c.buf, c.val + q * c.buf, c.cnt[q], k, q, sync, scratch_k, scratch_v, cap,
                                maxima == nullptr ? nullptr : maxima + (size_t)q * gridDim.x);
    }
    if (KALOS_PROBE & PROBE_NO_APPEND) return -1;
#ifdef KALOS_STAMPS
    KALOS_T(t_append);
#endif
    if (!last_block(sync)) return -1;
    if (dynamic && threadIdx.x == 0) {  // every block is past its scan: ready for the next
        *next_row = 0;
        if (KALOS_ALTERNATE) *sync_dir(sync) = !rev;
    }
#ifdef KALOS_STAMPS
    if (threadIdx.x == 0) { kalos_stamps[0] = t_loop; kalos_stamps[1] = t_append; }
    KALOS_STAMP(2);
#endif
    if (KALOS_PROBE & PROBE_NO_MERGE) {
        if (threadIdx.x < QB) { sync_count(sync)[threadIdx.x] = 0; sync_bound(sync)[threadIdx.x] = f2ord(neg_inf()); }
        return -1;
    }
    for (int q = 0; q < nq && q < QB; q++)
        merge_appended<QB, search>(c, p, q, k, sync, scratch_k, scratch_v, cap,
                                   maxima == nullptr ? nullptr : maxima + (size_t)q * gridDim.x);
    return c.cnt[0];
}

template <typename T, int TPR, int QB, int METRIC>
__global__ void __launch_bounds__(KALOS_BLOCK)
scan_topk(const T* __restrict__ data, const int* __restrict__ ns, const float* __restrict__ sqnorm,
          const float* __restrict__ rowscale, const Params* __restrict__ p,
          const float* __restrict__ qbuf, const signed char* __restrict__ qbuf_i8, int ld, int buf,
          float* __restrict__ scratch_k, int* __restrict__ scratch_v,
          unsigned int* __restrict__ sync) {
    extern __shared__ float smem[];
    if (scan_body<T, TPR, QB, METRIC>(data, ns, sqnorm, rowscale, p, qbuf, qbuf_i8, ld, buf, scratch_k,
                                      scratch_v, sync, smem) >= 0)
        final_fence();
}

// scan_list<T, TPR, QB, METRIC>: scan_topk over a list of rows (Params::ns_id NS_LIST,
// Params::mask the list, Params::n_rows its length), for a selective filter: where a mask
// makes the scan walk every row of the index (a namespace id and a mask byte each, and a
// round per grid's worth of rows, most of them dropped), the list walks only the rows the
// filter keeps. Its own kernel, so that scan_topk's code and registers stay as they were.
template <typename T, int TPR, int QB, int METRIC>
__global__ void __launch_bounds__(KALOS_BLOCK)
scan_list(const T* __restrict__ data, const int* __restrict__ ns, const float* __restrict__ sqnorm,
          const float* __restrict__ rowscale, const Params* __restrict__ p,
          const float* __restrict__ qbuf, const signed char* __restrict__ qbuf_i8, int ld, int buf,
          float* __restrict__ scratch_k, int* __restrict__ scratch_v,
          unsigned int* __restrict__ sync) {
    extern __shared__ float smem[];
    if (scan_body<T, TPR, QB, METRIC, SCAN_LIST>(data, ns, sqnorm, rowscale, p, qbuf, qbuf_i8, ld, buf,
                                                 scratch_k, scratch_v, sync, smem) >= 0)
        final_fence();
}

// ------------------------------------------------------------------------------------------
// doorbell_topk<T, TPR, METRIC>: the resident kernel. Launched once and left running, it answers
// batch-1 recalls that clients hand it through the mapped segment, with no host work at all:
//
//   block 0, warp 0   polls the slots' state words (host memory, over PCIe) for DOORBELL;
//   block 0           checks the request, marks the slot BUSY, reads the query from the slot,
//                     normalizes it into qbuf, writes params, and bumps the generation `gen`;
//   every block       (waiting on gen in L2) runs scan_body: the fused scan, then the merge,
//                     which writes rows and scores to the slot: block 0's of the blocks' tagged
//                     lists for k <= 32 (ll_merge), the last block's of the appended lists above;
//   that block        writes each hit's arena generation (or entry) into the blob, the response words,
//                     then state = RESPONSE, and marks the request done.
//
// Block 0 takes the next request only after `done` says the merging block answered the last
// one, which is after every block finished its scan (with the tagged lists: wrote its head;
// it may still be selecting and writing the rest of its list, in its own part of the area
// (ll_list), reading nothing the next request rewrites; params, qbuf and the merge's scratch
// are reused). A request it does not take as it stands
// (another op, a filter, a namespace, vectors asked, k above max_k) goes back to the sidecar as
// REQUEST; so do all of them when several wait at once: the sidecar's batched path answers a
// crowd with one pass over the rows, the resident kernel would make one pass each. The host
// stops the kernel (ctl->stop) before it changes rows or launches other work; a request in
// hand is answered first. Host memory is read with volatile loads (never cached), params and
// qbuf through L2.

#define ST_REQUEST 2
#define ST_BUSY 3
#define ST_RESPONSE 4
#define ST_DOORBELL 6
#define OP_RECALL 2
#define FLAG_ARENA_DOCS 4
#define RESP_ARENA_DOCS 4
#define FLAG_ARENA_ENTRIES 8  // with ARENA_DOCS (protocol v1.3): the arena version, then whole entries
#define RESP_ARENA_ENTRIES 8
// A slot's control words by 32-bit index (byte offset / 4: CTL_OFFSETS in
// kalos_retrievers/protocol.py; tests/unit/test_kernel_constants.py checks them)
#define W_SEQ 2          // u64
#define W_OP 4
#define W_FLAGS 5
#define W_TOP_K 6
#define W_N_ITEMS 7
#define W_VEC_LEN 8      // u64
#define W_ARGS_LEN 10    // u64
#define W_REQUEST 12     // the words block 0 reads: state .. args_len
#define W_RESP_SEQ 14    // u64
#define W_STATUS 16
#define W_N_RESULTS 17
#define W_RESP_LEN 18    // u64
#define W_RESP_FLAGS 20  // u64

// In registered, mapped host memory. The host writes the first 128-byte line while the kernel
// is stopped and copies it to the device before each launch (the kernel reads its settings
// from that copy); while it runs, only `stop` is written (by the host, polled by the kernel).
// What the kernel writes lives on the next line.
struct BellCtl {
    int stop;                    // the host sets 1: the kernel returns (after the request in hand)
    int n_rows;                  // rows [0, n_rows) are scanned
    int ns_id;                   // the default namespace's id, NS_ANY when dense, -3 when absent
    int n_slots;
    u64 seg;                     // device address of the mapped segment
    u64 slot0;                   // byte offset of slot 0
    u64 slot_size;
    int payload_off, rows_off, scores_off, blob_off;
    int dim, max_k;
    u64 arena;                   // device address of the mapped arena's row table (16-byte entries)
    int arena_rows;
    int mode;                    // BELL_* bits: how host memory is read and written
    u64 arena_version;           // the version of that arena (ARENA_ENTRIES answers name it)
    u64 exact;                   // int8 storage: device address of the registered host copy of the
                                 // rows in float16 (row r at exact + 2 * ld * r), for re-scoring
    int rescore;                 // int8 storage: candidates scanned per result (0 otherwise)
    int n_spaces;                // entries of `spaces` (0: the default namespace's recalls only)
    u64 spaces;                  // device address of the namespaces it serves besides the default
                                 // one (BellSpaces, written by the host before the launch)
    u64 host_pad[2];             // to 128 bytes
    u64 served;                  // (offset 128) recalls this kernel answered (it counts; the host reads)
    u64 stamp[12];               // %globaltimer (ns) of the last request: [0] taken, [1] launched to
                                 // the blocks, [2] merged (response begins), [3] answered, [4] polling
                                 // began; [5] polls until taken; at a stop: [6] stop seen, [7] polls;
                                 // [8] block 0 began, [9] the last block returned; [10] int8:
                                 // re-scored, rows and scores written (merged -> [11] every
                                 // candidate's exact score in -> [10] -> answered)
                                 // (diagnostics: benchmarks/doorbell_probe.py)
};

// The scopes a resident kernel serves besides the default namespace (BellCtl::spaces, device
// memory, written by the host before each launch; sidecar/index_gpu.py bell_spaces_table): a
// recall whose args are exactly entry i's image (protocol.encode_recall_args of a namespace and
// an optional filter: u16 length, the name's UTF-8, u32 length, the filter's JSON, zero-padded
// to 128 bytes; `len` bytes of it count) is answered over the rows of namespace id[i] for
// which mask[i] (a device uint8 per row, 1 = the filter keeps it; 0: no filter) is nonzero;
// or, where id[i] is NS_LIST, over the rows[i] rows of the int32 list mask[i] points to (a
// selective filter's). Any other args go back to the sidecar. The host names only namespaces
// that exist and builds each mask and list from the rows as they are while the kernel runs
// (it stops the kernel before any row changes), so no id, mask or list can go stale under it.
#define BELL_SPACES_MAX 8
#define BELL_ARGS_WORDS 32       // 128 bytes, one word per lane of warp 1
#define BELL_IMAGE_WORDS 256     // BELL_SPACES_MAX x BELL_ARGS_WORDS: entry i's at i x BELL_ARGS_WORDS
struct BellSpaces {
    int id[BELL_SPACES_MAX];
    int len[BELL_SPACES_MAX];
    u64 mask[BELL_SPACES_MAX];
    unsigned int image[BELL_IMAGE_WORDS];
    int rows[BELL_SPACES_MAX];   // a list's length (id NS_LIST); unused otherwise. Last, so that
                                 // the other fields sit where they did before lists (session 54)
};
static_assert(BELL_IMAGE_WORDS == BELL_SPACES_MAX * BELL_ARGS_WORDS, "an image per entry");

// How the kernel touches host memory (BellCtl::mode), so one build can compare them
// (benchmarks/doorbell_probe.py --modes). Plain volatile accesses (mode 0) are what session 4
// measured. Every access is an `asm volatile`: a plain `asm` (as CUDA's __ldcv is) may be
// hoisted out of a polling loop, which then never sees the host's write (S5-1: stuck).
#define BELL_LDCV 1              // loads with ld.global.cv: a line of host memory held in L2 is
                                 // considered stale and fetched again
#define BELL_STWT 2              // stores with st.global.wt: written through L2 to host memory
#define BELL_FENCE 4             // a system fence after the RESPONSE word, pushing it out at once
#define BELL_SYS 8               // loads / stores not otherwise chosen: ld/st.relaxed.sys (the
                                 // memory model's own way to share words with the host)
#define BELL_ARENA_DEVICE 16     // float kernels: BellCtl::arena is a device copy of the arena's
                                 // row table (the host copies it while the kernel is stopped), not
                                 // the registered host table: each answer's entries without a PCIe
                                 // round trip (sidecar/index_gpu.py, BELL_ARENA_DEVICE)

__device__ __forceinline__ unsigned int hload32(const void* p, int mode) {
    unsigned int v;
    if (mode & BELL_LDCV) asm volatile("ld.global.cv.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    else if (mode & BELL_SYS) asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    else v = *reinterpret_cast<const volatile unsigned int*>(p);
    return v;
}

// 16 bytes in one load (the query: each thread's loads would otherwise be round trips in turn)
__device__ __forceinline__ uint4 hload4(const void* p, int mode) {
    uint4 v;
    if (mode & BELL_LDCV)
        asm volatile("ld.global.cv.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    else if (mode & BELL_SYS)
        asm volatile("ld.relaxed.sys.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    else
        asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}

template <typename T>
__device__ __forceinline__ T hload(const T* p, int mode) {
    static_assert(sizeof(T) == 4, "32-bit words");
    unsigned int v = hload32(p, mode);
    T out;
    memcpy(&out, &v, 4);
    return out;
}

__device__ __forceinline__ void hstore(unsigned int* p, unsigned int v, int mode) {
    if (mode & BELL_STWT) asm volatile("st.global.wt.u32 [%0], %1;" : : "l"(p), "r"(v) : "memory");
    else if (mode & BELL_SYS) asm volatile("st.relaxed.sys.global.u32 [%0], %1;" : : "l"(p), "r"(v) : "memory");
    else *reinterpret_cast<volatile unsigned int*>(p) = v;
}

__device__ __forceinline__ void hstore(int* p, int v, int mode) {
    hstore(reinterpret_cast<unsigned int*>(p), (unsigned int)v, mode);
}

__device__ __forceinline__ void hstore(u64* p, u64 v, int mode) {
    if (mode & BELL_STWT) asm volatile("st.global.wt.u64 [%0], %1;" : : "l"(p), "l"(v) : "memory");
    else if (mode & BELL_SYS) asm volatile("st.relaxed.sys.global.u64 [%0], %1;" : : "l"(p), "l"(v) : "memory");
    else *reinterpret_cast<volatile u64*>(p) = v;
}

// gpu-scope acquire load and release add (sm_70+): the ordering of a fence without the cost of
// fence.sc (__threadfence), which waits for every write the thread has in flight (~1-2 µs on an
// H200 mid-scan: the carousel's profile, session 36).
__device__ __forceinline__ unsigned int ld_acquire(const unsigned int* p) {
    unsigned int v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void red_release_add(unsigned int* p, unsigned int v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned int sm_id() {
    unsigned int id;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
    return id;
}

__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Device words (zeroed by the host before each launch): [0] gen, [1] done, [2] stop seen,
// [3] the slot in hand (bit 31: the request asked for ARENA_ENTRIES), [4..5] its seq, [6] requests
// answered since the launch, [7] blocks returned, [8] the request's k (int8: the scan looks for
// more candidates than that); [9..11] unused since session 16 (int8's re-scoring hand-out, its
// count and its done count: now tagged records in the candidate area, bell_handout).
#define BELL_WORDS 12

// Block 0's poll reads up to 32 x BELL_POLL_WIDE slots' state words per round trip (with more
// slots, another round trip per that many). 2: the sidecar's default 16 slots and the 40 of
// benchmarks/gpu_recall.py in one.
#ifndef BELL_POLL_WIDE
#define BELL_POLL_WIDE 2
#endif

__device__ __forceinline__ unsigned int vload(const unsigned int* p) {
    return *reinterpret_cast<const volatile unsigned int*>(p);
}

// The int8 resident kernel's candidate area (`cand`, device memory, zeroed by the host before
// each launch; BELL_CAND_WORDS x KALOS_CAND_MAX words): the merge's output (rows, then
// quantized scores), then per candidate a hand-out record (one u64), then a result record
// (BELL_RESULT_U64 u64: the exact dot product, the row's sum of squares, the four words of its
// arena entry, two spare). Every u64 of a record carries the request's tag (`seen`, from 1 in a
// launch) in its high half and one 32-bit value in its low half, so a reader that sees the tag
// in every u64 it needs has this request's values, with no fence and no count between writer
// and reader: writers and readers use volatile (relaxed, system-scope) accesses, for which an
// aligned 64-bit access is single-copy atomic and a v2.u64 access is two of them. A record
// zeroed at the launch reads as tag 0, which `seen` would reach after 2^32 requests: block 0
// hands requests back to the sidecar after tag BELL_LAST_TAG, and the sidecar's next launch
// starts over from zeroed records.
#define BELL_CAND_WORDS 20
#define BELL_RESULT_U64 8
#define BELL_LAST_TAG 0xFFFFFFFFu
static_assert(4 + 2 * BELL_RESULT_U64 <= BELL_CAND_WORDS, "rows, scores, hand-out and result records per candidate");
__device__ __forceinline__ u64* bell_handout(int* cand) { return reinterpret_cast<u64*>(cand + 2 * KALOS_CAND_MAX); }
__device__ __forceinline__ u64* bell_results(int* cand) { return reinterpret_cast<u64*>(cand + 4 * KALOS_CAND_MAX); }
// candidate i's arena entry from its result record, once this request's (tag) is there
__device__ __forceinline__ uint4 result_entry(const u64* results, int i, unsigned int tag) {
    const u64* o = results + (size_t)BELL_RESULT_U64 * i;
    ulonglong2 a, b;
    do {
        a = vload128(o + 2);
        b = vload128(o + 4);
    } while (!(tagged(a, tag) && tagged(b, tag)));
    return make_uint4((unsigned int)a.x, (unsigned int)a.y, (unsigned int)b.x, (unsigned int)b.y);
}

// int8 storage, the resident kernel: the exact scores of the int8 scan's candidates, from the
// float16 copy of their rows in registered host memory (row r at exact + 2 * ld * r bytes), as
// the sidecar's host path does (_rescore in sidecar/index_gpu.py). Every block b < kc takes
// part: it waits for the hand-out record of candidate i = b (then b + gridDim.x, ...), which the
// last block writes for every i < kc once the merge is done (row -1 past the n candidates the
// merge found: the block stops there), loads the row (one 16-byte chunk per thread for rows up
// to 2,048 dimensions) with the row's arena entry (thread 0, the same round trip: the answer
// needs it for its best k; zero for a row the table does not cover), and writes the dot
// product with the float query (qbuf, ld floats, zero past dim), the row's sum of squares and
// the entry to candidate i's result record, tagged. All threads of the block call it.
//
// Why the grid and not the last block alone: host memory is read over PCIe (~2.1 µs for a
// random 1.5 KB row on the H200, pcie_probe.py), and one block's loads of 40 rows took 13.6 µs
// (S10-5: ~6 round trips; one SM keeps only so many reads in flight), where 20 blocks each
// read one row in about one round trip. Why tagged records (session 16; before, a hand-out
// word, a count of candidates and a done count, each behind a fence): the waiting block gets
// its row in the word it polls, and the last block each score in the record it polls, which
// takes ~4 dependent L2 round trips and two fences out of the re-scoring (S16-1: 10.0 µs,
// of which 6.6 from the hand-out to the count seen, for a 2.1-2.2 µs read).
template <int METRIC>
__device__ void rescore_share(const u64* handout, int kc, const float* qbuf, u64 exact, int ld, int mode,
                              u64* results, u64 arena, int arena_rows, unsigned int tag) {
    __shared__ float s_d[KALOS_BLOCK / 32], s_s[KALOS_BLOCK / 32];
    __shared__ int s_row;
    const int chunks = ld / 8;  // 8 halves per 16 bytes (ld: a multiple of 16 for int8 rows)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u64 t = (u64)tag << 32;
    for (int i = blockIdx.x; i < kc; i += gridDim.x) {
        if (threadIdx.x == 0) {
            u64 h;
            while ((unsigned int)((h = vload64(handout + i)) >> 32) != tag) { }
            s_row = (int)(unsigned int)h;
        }
        __syncthreads();
        const int r = s_row;
        if (r < 0) break;  // block-uniform: past the candidates (and so is every later i)
        const u64 row = exact + 2ull * ld * (u64)r;
        uint4 e = make_uint4(0u, 0u, 0u, 0u);  // no such entry: length 0 (the client asks again)
        if (threadIdx.x == 0 && r < arena_rows) e = hload4(reinterpret_cast<const void*>(arena + 16ull * r), mode);
        float d = 0.f, sq = 0.f;
        for (int ch = threadIdx.x; ch < chunks; ch += blockDim.x) {
            const uint4 v = hload4(reinterpret_cast<const void*>(row + 16ull * ch), mode);
            const float4 qa = __ldcg(reinterpret_cast<const float4*>(qbuf + 8 * ch));
            const float4 qb = __ldcg(reinterpret_cast<const float4*>(qbuf + 8 * ch + 4));
            const __half2* h = reinterpret_cast<const __half2*>(&v);
            const float2 f0 = __half22float2(h[0]), f1 = __half22float2(h[1]);
            const float2 f2 = __half22float2(h[2]), f3 = __half22float2(h[3]);
            d += f0.x * qa.x + f0.y * qa.y + f1.x * qa.z + f1.y * qa.w
               + f2.x * qb.x + f2.y * qb.y + f3.x * qb.z + f3.y * qb.w;
            if (METRIC == METRIC_L2)
                sq += f0.x * f0.x + f0.y * f0.y + f1.x * f1.x + f1.y * f1.y
                    + f2.x * f2.x + f2.y * f2.y + f3.x * f3.x + f3.y * f3.y;
        }
        for (int o = 16; o > 0; o >>= 1) {
            d += __shfl_xor_sync(0xffffffffu, d, o);
            if (METRIC == METRIC_L2) sq += __shfl_xor_sync(0xffffffffu, sq, o);
        }
        if (lane == 0) { s_d[warp] = d; s_s[warp] = sq; }
        __syncthreads();
        if (threadIdx.x == 0) {
            float td = 0.f, ts = 0.f;
            for (int w = 0; w < KALOS_BLOCK / 32; w++) { td += s_d[w]; ts += s_s[w]; }
            u64* o = results + (size_t)BELL_RESULT_U64 * i;
            vstore128(o, t | __float_as_uint(td), t | __float_as_uint(ts));
            vstore128(o + 2, t | e.x, t | e.y);
            vstore128(o + 4, t | e.z, t | e.w);
        }
        __syncthreads();  // s_d, s_s and s_row free for the next candidate
    }
}

// The last block: the exact scores of the n candidates (as the scan scores rows: L2 as minus
// the distance), each read from its result record once this request's tag is there, into
// key[0, n) with their indices in val, sorted best first (exact ties by that index: the order
// of the quantized scores). key/val hold next_pow2(n) entries (the merge's buffer: see _buf in
// index_gpu.py). Up to 32 candidates (top-16 and below at the default factor) one warp ranks
// them by comparing each with all (no barrier per step, as the bitonic sort needs for more).
// It stamps when every score was in (`stamp`, host memory: diagnostics). All threads of the
// block call it.
template <int METRIC>
__device__ void rescored_order(float* key, int* val, int n, const u64* results, float qnorm2, unsigned int tag,
                               u64* stamp, int mode) {
    const int p = next_pow2(n < 2 ? 2 : n);
    for (int i = threadIdx.x; i < p; i += blockDim.x) {
        if (i < n) {
            ulonglong2 a;
            do { a = vload128(results + (size_t)BELL_RESULT_U64 * i); } while (!tagged(a, tag));
            float s = __uint_as_float((unsigned int)a.x);
            if (METRIC == METRIC_L2) s = -sqrtf(fmaxf(qnorm2 + __uint_as_float((unsigned int)a.y) - 2.f * s, 0.f));
            key[i] = s;
            val[i] = i;
        } else {
            key[i] = neg_inf();
            val[i] = 0x7fffffff;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) hstore(stamp, global_ns(), mode);
    if (p <= 32) {  // block-uniform
        if (threadIdx.x < 32) {
            const int lane = threadIdx.x;
            // a total order: ordered bit patterns (-0 as +0), ties by position
            const float k = lane < p ? key[lane] : neg_inf();
            const int v = lane < p ? val[lane] : 0x7fffffff;
            const int o = f2ord(k + 0.f);
            int rank = 0;
            for (int j = 0; j < 32; j++) {
                const int oj = __shfl_sync(0xffffffffu, o, j);
                rank += (oj > o || (oj == o && j < lane)) ? 1 : 0;
            }
            __syncwarp();
            if (lane < p) { key[rank] = k; val[rank] = v; }
        }
        __syncthreads();
    } else {
        bitonic_desc(key, val, p);
    }
}

// The resident kernel's least blocks per SM (__launch_bounds__'s second argument; 0: none, the
// compiler's choice), by row type. Float16's is 3: it caps the kernel at 80 registers (112
// without), with no spill for cosine and inner product at 2-32 threads per row (the L2 metric,
// and 1 thread per row, below 256-d, spill 12 bytes: not measured apart), and the host
// (resident_blocks_per_sm) then keeps 3 of its blocks on each SM of an H200:
// S13-1 measured 100k rows 69.5 -> 65.3 us and 1M 376.9 -> 370.6 in process. int8 gained
// nothing from 3 (80 registers, 8 bytes spilled) and lost 28-52 us with 4 (64 registers, its
// loads in flight cut to 4). int8's is 2 since its split scan (KALOS_SCAN_SPLIT_I8), which
// compiles to 185 registers without a bound and to 128 without a spill at 2 (6 loads in
// flight), the registers and the 2 blocks per SM the earlier int8 kernel had; float32: 2 (the
// 2 blocks per SM its 114 registers allowed before S21-2; with 0, its settings read from shared
// memory, ptxas chose 80 registers and spilled 16 bytes).
#ifndef KALOS_BELL_MINB_H
#define KALOS_BELL_MINB_H 3
#endif
#ifndef KALOS_BELL_MINB_I8
#define KALOS_BELL_MINB_I8 2
#endif
#ifndef KALOS_BELL_MINB_F
#define KALOS_BELL_MINB_F 2
#endif
template <typename T> struct BellMinBlocks { static constexpr int value = KALOS_BELL_MINB_F; };
template <> struct BellMinBlocks<__half> { static constexpr int value = KALOS_BELL_MINB_H; };
template <> struct BellMinBlocks<signed char> { static constexpr int value = KALOS_BELL_MINB_I8; };

// LISTS: the build that also serves scopes of id NS_LIST (a selective filter's list of rows),
// which the host launches only while it serves one: its default-namespace recall is slower
// than the build without's, so the host keeps the build without for every other start. With
// the scan body twice in it (the list's and the mask's) that cost was ~3.8-4.3 µs in an index
// of 100k-201k rows (S52-4, S54-6, H100). Since session 54 it holds one body that decides per
// row (SCAN_EITHER): +2.2 µs at 201k rows (S54-6), ptxas' registers, stack and 4-byte spill
// those of the build without, and half the compile (nvcc, float16 cosine: 8.9 -> 4.0 s).
template <typename T, int TPR, int METRIC, bool LISTS>
__global__ void __launch_bounds__(KALOS_BLOCK, BellMinBlocks<T>::value)
doorbell_topk(const T* __restrict__ data, const int* __restrict__ ns, const float* __restrict__ sqnorm,
              const float* __restrict__ rowscale, Params* params, float* qbuf, signed char* qbuf_i8,
              int ld, int buf, float* __restrict__ scratch_k, int* __restrict__ scratch_v,
              unsigned int* __restrict__ sync, BellCtl* ctl_, const BellCtl* __restrict__ cfg,
              unsigned int* bell, int* cand) {
    extern __shared__ float smem[];
    __shared__ Params sp;        // this request's params (a copy: the scan reads them often)
    __shared__ int s_go;         // block 0: the slot taken (-1 none yet, -2 stop); others: 1 go, -2 stop
    __shared__ float s_red[KALOS_BLOCK / 32];
    // The host's settings, from the device copy `cfg` the host makes before each launch: read
    // from host memory by every thread of every block, they were ~23k PCIe reads that held the
    // kernel's start back ~10 ms (S5-2). Only `stop` is read from host memory (ctl_).
    // The settings themselves are read from a shared-memory copy, S, where they are used
    // (volatile: not held in registers across the request loop). Held in registers (before
    // S21-2) they left the float16 kernel's 80 no room for the scan's final selection
    // (warp_select): ptxas spilled values it reloaded once per request, from local memory the
    // scan had evicted (the respond stamp 2.3 -> 2.7 µs). Shared memory is never evicted.
    __shared__ uint4 s_cfg[8];
    if (threadIdx.x < 8) s_cfg[threadIdx.x] = reinterpret_cast<const uint4*>(cfg)[threadIdx.x];
    __syncthreads();
    const volatile BellCtl& S = *reinterpret_cast<const volatile BellCtl*>(s_cfg);
    const int mode = cfg->mode;  // (in a register: every host load and store tests it)
    if (blockIdx.x == 0 && threadIdx.x == 0) hstore(&ctl_->stamp[8], global_ns(), mode);
    // the last block to return stamps it (how long a stop takes on the GPU's side)
    auto leave = [&]() {
        if (threadIdx.x == 0 && atomicAdd(bell + 7, 1u) == gridDim.x - 1) {
            hstore(&ctl_->stamp[9], global_ns(), mode);
            __threadfence_system();
        }
    };
    // requests this block has taken part in, in shared memory: held in a register, ptxas spilled
    // it at the loop's top and reloaded it for the answer, from memory the scan had evicted
    // (S21-2: the respond stamp 2.3 -> 2.7 µs with the warp selection's registers)
    __shared__ unsigned int s_seen;
    auto seen = [&]() -> unsigned int { return *reinterpret_cast<volatile unsigned int*>(&s_seen); };
    if (threadIdx.x == 0) s_seen = 0u;
    // block 0: the namespaces it serves besides the default one, once per launch (the host
    // changes them only while the kernel is stopped)
    __shared__ BellSpaces s_spaces;
    if (blockIdx.x == 0 && S.n_spaces > 0) {
        const unsigned int* src = reinterpret_cast<const unsigned int*>(S.spaces);
        unsigned int* dst = reinterpret_cast<unsigned int*>(&s_spaces);
        for (int i = threadIdx.x; i < (int)(sizeof(BellSpaces) / 4); i += blockDim.x) dst[i] = src[i];
    }
    __syncthreads();
    unsigned int rot = 0;        // where the poll starts (fairness between slots)
    for (;;) {
        if (blockIdx.x == 0) {
            if (threadIdx.x == 0) {
                while (vload(bell + 1) != seen()) { }  // every block done with the last
                s_go = -1;
            }
            __syncthreads();
            if (threadIdx.x < 32) {
                const int lane = threadIdx.x;
                const u64 t_poll = global_ns();
                // the poll's settings in registers while it polls (read from S once, not per load)
                const int n_slots = S.n_slots;
                const u64 slots = S.seg + S.slot0, slot_size = S.slot_size;
                u64 polls = 0;
                for (;; polls++) {
                    // Up to 32 x BELL_POLL_WIDE words per round trip of PCIe (~1.8-2.1 µs,
                    // benchmarks/pcie_probe.py), every load in flight before any is used: the
                    // state word of each slot, and at index n_slots the stop word. Read one
                    // after another (the stop word, then each 32 slots) they took a round trip
                    // each: three with 40 slots, and a request waited half a round more to be
                    // seen. (The stop word in its own register made int8's kernel spill.)
                    int mine = -1, count = 0, stop = 0;
                    for (int b = 0; b <= n_slots; b += 32 * BELL_POLL_WIDE) {
                        unsigned int st[BELL_POLL_WIDE];
#pragma unroll
                        for (int j = 0; j < BELL_POLL_WIDE; j++) {
                            const int i = b + 32 * j + ((lane + rot) & 31);
                            const unsigned int* w = i < n_slots ? reinterpret_cast<const unsigned int*>(slots + (u64)i * slot_size)
                                                                : reinterpret_cast<const unsigned int*>(&ctl_->stop);
                            st[j] = i <= n_slots ? hload(w, mode) : 0u;
                        }
#pragma unroll
                        for (int j = 0; j < BELL_POLL_WIDE; j++) {
                            const int i = b + 32 * j + ((lane + rot) & 31);
                            const bool bell_rung = i < n_slots && st[j] == ST_DOORBELL;
                            count += __popc(__ballot_sync(0xffffffffu, bell_rung));
                            stop |= __ballot_sync(0xffffffffu, i == n_slots && st[j] != 0u);
                            if (bell_rung && mine < 0) mine = i;
                        }
                    }
                    if (stop) {  // (warp-uniform) a stop wins over a request seen with it
                        if (lane == 0) {
                            s_go = -2;
                            hstore(&ctl_->stamp[4], t_poll, mode);
                            hstore(&ctl_->stamp[6], global_ns(), mode);
                            hstore(&ctl_->stamp[7], polls, mode);
                        }
                        break;
                    }
                    if (count == 0) continue;  // no sleep: __nanosleep was not the ~80 us (S4-7)
                    rot += 7;
                    // a crowd: the sidecar's batched path serves it better. int8: once a request
                    // was tagged BELL_LAST_TAG, the next would be tag 0, which zeroed records
                    // carry: the sidecar answers from then on, and its next launch starts over
                    if (count > 1 || (Vec<T>::INT8 && seen() == BELL_LAST_TAG)) {
                        for (int b = 0; b < n_slots; b += 32) {
                            int i = b + lane;
                            if (i < n_slots) {
                                unsigned int* w = reinterpret_cast<unsigned int*>(slots + (u64)i * slot_size);
                                if (hload(w, mode) == ST_DOORBELL) hstore(w, (unsigned int)ST_REQUEST, mode);
                            }
                        }
                        __threadfence_system();
                        continue;
                    }
                    unsigned int who = __ballot_sync(0xffffffffu, mine >= 0);
                    int src = __ffs(who) - 1;
                    int slot = __shfl_sync(0xffffffffu, mine, src);
                    if (lane == 0) {
                        s_go = slot;
                        hstore(&ctl_->stamp[4], t_poll, mode);
                        hstore(&ctl_->stamp[5], polls, mode);
                    }
                    break;
                }
            }
            __syncthreads();
            const int slot = s_go;
            if (slot == -2) {
                if (threadIdx.x == 0) { bell[2] = 1; __threadfence(); }
                leave();
                return;
            }
            const u64 sb = S.seg + S.slot0 + (u64)slot * S.slot_size;
            // The request's control words (host memory), read once, into shared memory: a
            // client rewriting them meanwhile must not split the block's decision. One load
            // per lane of warp 0, in flight together: read one after another, 12 words cost
            // ~14 us (S5-1, persistent_probe.py), each a PCIe round trip. The query (16 bytes
            // per thread where the payload allows: one round trip, not one per word) is read
            // into qbuf in the same round trip, before the words are used: where it lies does
            // not depend on them (a recall's payload starts with its 4 x dim bytes, and every
            // slot's payload holds that many). Read after the words were checked, it cost a
            // second round trip. When the words say the request is not the kernel's, qbuf
            // (free: every block is done with the last request) holds it unused.
            __shared__ unsigned int s_w[W_REQUEST];
            __shared__ unsigned int s_args[BELL_ARGS_WORDS];
            __shared__ int s_ok, s_req_ns;
            __shared__ int s_req_rows;  // (LISTS: a list's length; unused otherwise)
            __shared__ u64 s_req_mask;
            __threadfence_system();  // the words and the query after the state word that announced them
            unsigned int word = 0;
            if (threadIdx.x < W_REQUEST) word = hload(reinterpret_cast<const unsigned int*>(sb) + threadIdx.x, mode);
            // With scopes to serve, warp 1 reads the args' first 128 bytes (at the query's
            // 8-byte-aligned end, where the client writes them), a word per lane, in the same
            // round trip: a namespace's name and a filter, which block 0 compares with the
            // ones it serves. Unused when args_len says there are none.
            unsigned int aword = 0;
            const int aj = (int)threadIdx.x - 32;
            if (aj >= 0 && aj < BELL_ARGS_WORDS && S.n_spaces > 0) {
                const u64 aoff = (u64)S.payload_off + ((4ull * (u64)S.dim + 7ull) & ~7ull) + 4ull * (u64)aj;
                if (aoff + 4ull <= (u64)S.rows_off) aword = hload(reinterpret_cast<const unsigned int*>(sb + aoff), mode);
            }
            const float* q = reinterpret_cast<const float*>(sb + S.payload_off);
            const bool q16 = ((sb + S.payload_off) & 15) == 0;
            float part = 0.f, amax = 0.f;
            for (int i = 4 * threadIdx.x; i < ld; i += 4 * blockDim.x) {
                float v[4];
                if (q16 && i + 3 < S.dim) {
                    uint4 u = hload4(q + i, mode);
                    v[0] = __uint_as_float(u.x); v[1] = __uint_as_float(u.y);
                    v[2] = __uint_as_float(u.z); v[3] = __uint_as_float(u.w);
                } else {
#pragma unroll
                    for (int j = 0; j < 4; j++) v[j] = i + j < S.dim ? hload(q + i + j, mode) : 0.f;
                }
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    if (i + j < ld) qbuf[i + j] = v[j];
                    part += v[j] * v[j];
                    amax = fmaxf(amax, fabsf(v[j]));
                }
            }
            // its norm and largest |x|, each warp's into shared memory (held in registers
            // through the words' check, they made int8's resident kernel spill)
            for (int o = 16; o > 0; o >>= 1) {
                part += __shfl_xor_sync(0xffffffffu, part, o);
                amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
            }
            __shared__ float s_amax[KALOS_BLOCK / 32];
            if ((threadIdx.x & 31) == 0) { s_red[threadIdx.x >> 5] = part; s_amax[threadIdx.x >> 5] = amax; }
            if (threadIdx.x < W_REQUEST) s_w[threadIdx.x] = word;
            if (aj >= 0 && aj < BELL_ARGS_WORDS) s_args[aj] = aword;
            __syncthreads();
            if (threadIdx.x == 0) {
                const u64 vec_len = (u64)s_w[W_VEC_LEN] | ((u64)s_w[W_VEC_LEN + 1] << 32);
                const u64 args_len = (u64)s_w[W_ARGS_LEN] | ((u64)s_w[W_ARGS_LEN + 1] << 32);
                // the rows it asks for: no args, the default namespace (-3: empty); args, the
                // namespace and filter mask whose image they are, byte for byte (bytes past
                // args_len do not count)
                int req_ns = S.ns_id, req_rows = 0;  // (req_rows: LISTS, a list's length)
                u64 req_mask = 0;
                bool scope = args_len == 0 && req_ns != -3;
                if (args_len != 0 && args_len <= 4ull * BELL_ARGS_WORDS) {
                    const int n_spaces = min((int)S.n_spaces, BELL_SPACES_MAX);
                    for (int e = 0; e < n_spaces && !scope; e++) {
                        if ((u64)s_spaces.len[e] != args_len) continue;
                        bool same = true;
                        for (int j = 0; j < BELL_ARGS_WORDS && same; j++) {
                            const int v = (int)args_len - 4 * j;  // bytes of word j that count
                            if (v <= 0) break;
                            const unsigned int m = v >= 4 ? 0xFFFFFFFFu : (1u << (8 * v)) - 1u;
                            same = (s_args[j] & m) == s_spaces.image[e * BELL_ARGS_WORDS + j];
                        }
                        if (same) {
                            req_ns = s_spaces.id[e];
                            req_mask = s_spaces.mask[e];
                            if (LISTS && req_ns == NS_LIST) req_rows = s_spaces.rows[e];
                            scope = true;
                        }
                    }
                }
                s_req_ns = req_ns;
                if (LISTS) s_req_rows = req_rows;
                s_req_mask = req_mask;
                s_ok = s_w[W_OP] == OP_RECALL &&
                       (s_w[W_FLAGS] | FLAG_ARENA_ENTRIES) == (FLAG_ARENA_DOCS | FLAG_ARENA_ENTRIES) &&
                       s_w[W_N_ITEMS] == 1 && scope && vec_len == 4ull * S.dim && s_w[W_TOP_K] >= 1 &&
                       (int)s_w[W_TOP_K] <= S.max_k;
            }
            __syncthreads();
            const unsigned int top_k = s_w[W_TOP_K];
            const u64 seq = (u64)s_w[W_SEQ] | ((u64)s_w[W_SEQ + 1] << 32);
            if (!s_ok) {
                if (threadIdx.x == 0) {
                    hstore(reinterpret_cast<unsigned int*>(sb), (unsigned int)ST_REQUEST, mode);
                    __threadfence_system();
                }
                continue;  // the sidecar answers it (the client posts its doorbell on seeing REQUEST)
            }
            if (threadIdx.x == 0) {
                hstore(reinterpret_cast<unsigned int*>(sb), (unsigned int)ST_BUSY, mode);
                hstore(&ctl_->stamp[0], global_ns(), mode);
            }
            // the query's norm and largest |x| (the warps' are in shared memory: the
            // __syncthreads above)
            float ssq = 0.f;
            amax = 0.f;
            for (int i = 0; i < KALOS_BLOCK / 32; i++) { ssq += s_red[i]; amax = fmaxf(amax, s_amax[i]); }
            if (!isfinite(ssq)) {  // block-uniform: every thread summed the same s_red
                // NaN or infinity in the query (the client library never sends one; a client
                // writing its slot by hand can): back to the sidecar, which answers BAD_REQUEST
                // as it does for any request. Answered here, every score would be NaN and the
                // recall would come back OK with no results. (A finite query whose sum of
                // squares overflows, |x| above ~1e19, goes back too: the sidecar answers it.)
                if (threadIdx.x == 0) {
                    hstore(reinterpret_cast<unsigned int*>(sb), (unsigned int)ST_REQUEST, mode);
                    __threadfence_system();
                }
                continue;
            }
            const float scale = (METRIC == METRIC_COSINE && ssq > 0.f) ? rsqrtf(ssq) : 1.f;
            // int8 storage: the query's int8 copy too, scaled by max|q| / 127 (as prep_queries)
            const float qs = Vec<T>::INT8 && amax * scale > 0.f ? amax * scale / 127.f : 1.f;
            const float inv = 1.f / qs;
            if (METRIC == METRIC_COSINE || Vec<T>::INT8) {
                for (int i = threadIdx.x; i < ld; i += blockDim.x) {
                    const float x = qbuf[i] * scale;
                    if (METRIC == METRIC_COSINE) qbuf[i] = x;
                    if (Vec<T>::INT8) qbuf_i8[i] = (signed char)(int)fminf(fmaxf(rintf(x * inv), -127.f), 127.f);
                }
            }
            // int8: the scan finds rescore x k candidates (into `cand`, device memory); the last
            // block re-scores them exactly and answers the best k
            const int kc = Vec<T>::INT8 ? min(S.rescore * (int)top_k, KALOS_CAND_MAX) : (int)top_k;
            if (threadIdx.x == 0) {
                params->n_queries = 1;
                params->k = kc;
                // (S.n_rows read here, not in the decoding above, where the build without lists
                // would still load it: S is volatile. That load, and BellSpaces' rows before its
                // masks, made that build ~0.5 µs slower than the tree before lists, S54-5.)
                params->n_rows = LISTS && s_req_ns == NS_LIST ? s_req_rows : S.n_rows;
                params->ns_id = s_req_ns;
                params->mask = reinterpret_cast<const unsigned char*>(s_req_mask);
                params->out_ld = kc;
                params->seq = 0;
                params->out_rows[0] = Vec<T>::INT8 ? cand : reinterpret_cast<int*>(sb + S.rows_off);
                params->out_scores[0] = Vec<T>::INT8 ? reinterpret_cast<float*>(cand + KALOS_CAND_MAX)
                                                     : reinterpret_cast<float*>(sb + S.scores_off);
                params->qnorm2[0] = (METRIC == METRIC_COSINE && ssq > 0.f) ? 1.f : ssq;
                params->qscale[0] = qs;
                bell[8] = top_k;
                bell[3] = (unsigned int)slot | ((s_w[W_FLAGS] & FLAG_ARENA_ENTRIES) ? 0x80000000u : 0u);
                bell[4] = (unsigned int)seq;
                bell[5] = (unsigned int)(seq >> 32);
            }
            __threadfence();  // qbuf and params before gen
            __syncthreads();
            if (threadIdx.x == 0) {
                atomicAdd(bell, 1u);
                hstore(&ctl_->stamp[1], global_ns(), mode);
            }
        } else {
            if (threadIdx.x == 0) {
                for (;;) {
                    if (vload(bell) != seen()) { s_go = 1; break; }
                    if (vload(bell + 2)) { s_go = -2; break; }
                }
            }
            __syncthreads();
            if (s_go == -2) {
                leave();
                return;
            }
        }
        if (threadIdx.x == 0) s_seen = seen() + 1u;  // read after the barrier below
        __threadfence();
        // this request's params into shared memory, through L2
        {
            const unsigned int* src = reinterpret_cast<const unsigned int*>(params);
            unsigned int* dst = reinterpret_cast<unsigned int*>(&sp);
            for (int i = threadIdx.x; i < (int)(sizeof(Params) / 4); i += blockDim.x) dst[i] = __ldcg(src + i);
        }
        __syncthreads();
        int kk;
        if constexpr (LISTS) {  // a list's scope walks its rows (sp.ns_id NS_LIST: block-uniform, every block read sp)
            kk = scan_body<T, TPR, 1, METRIC, SCAN_EITHER>(data, ns, sqnorm, rowscale, &sp, qbuf, qbuf_i8, ld, buf,
                                                           scratch_k, scratch_v, sync, smem);
        } else {
            kk = scan_body<T, TPR, 1, METRIC>(data, ns, sqnorm, rowscale, &sp, qbuf, qbuf_i8, ld, buf, scratch_k,
                                              scratch_v, sync, smem);
        }
        if constexpr (Vec<T>::INT8) {
            // the candidates' exact scores, by blocks 0 .. kc - 1 (rescore_share): the last
            // block hands them out, a tagged record per candidate, once the merge is done
            const int kc = sp.k;  // what the scan kept (rescore x the request's k)
            if (kk >= 0) {
                if (threadIdx.x == 0) hstore(&ctl_->stamp[2], global_ns(), mode);
                const int* rows = reinterpret_cast<const int*>(smem + ld + buf);  // the merge's, best first
                u64* handout = bell_handout(cand);
                for (int i = threadIdx.x; i < kc; i += blockDim.x)
                    vstore64(handout + i, ((u64)seen() << 32) | (unsigned int)(i < kk ? rows[i] : -1));
                __syncthreads();  // rows read before rescored_order rewrites the buffer
            }
            rescore_share<METRIC>(bell_handout(cand), kc, qbuf, S.exact, ld, mode, bell_results(cand), S.arena, S.arena_rows,
                                  seen());
            if (kk < 0) continue;  // not the merging block: back to the wait for the next request
            rescored_order<METRIC>(smem + ld, reinterpret_cast<int*>(smem + ld + buf), kk, bell_results(cand),
                                   sp.qnorm2[0], seen(), &ctl_->stamp[11], mode);
            // vals: indices in cand, whose rows and entries the answer reads below
        }
        if (kk >= 0) {  // the merging block: its buffer holds the answer, sorted (int8: indices in cand)
            if (!Vec<T>::INT8 && threadIdx.x == 0) hstore(&ctl_->stamp[2], global_ns(), mode);
            int* vals = reinterpret_cast<int*>(smem + ld + buf);
            const unsigned int hand = __ldcg(bell + 3);
            const u64 sb = S.seg + S.slot0 + (u64)(hand & 0x7FFFFFFFu) * S.slot_size;
            if constexpr (Vec<T>::INT8) {  // the best k of the re-scored candidates into the slot
                const float* keys = smem + ld;
                const int top_k = (int)__ldcg(bell + 8);
                kk = min(kk, top_k);
                int* orow = reinterpret_cast<int*>(sb + S.rows_off);
                float* oscore = reinterpret_cast<float*>(sb + S.scores_off);
                for (int i = threadIdx.x; i < top_k; i += blockDim.x) {
                    hstore(orow + i, i < kk ? __ldcg(cand + vals[i]) : -1, mode);
                    hstore(reinterpret_cast<unsigned int*>(oscore + i), __float_as_uint(i < kk ? keys[i] : neg_inf()), mode);
                }
                if (threadIdx.x == 0) hstore(&ctl_->stamp[10], global_ns(), mode);
            }
            unsigned int* out = reinterpret_cast<unsigned int*>(sb + S.blob_off);
            const bool entries = hand >> 31;
            if (entries) {
                // the arena's version, then each hit's whole entry (offset, length, gen): the
                // client copies the record without reading the row table. Nothing writes the
                // arena while this kernel runs (the sidecar stops it first).
                if (threadIdx.x == 0) {
                    hstore(out, (unsigned int)S.arena_version, mode);
                    hstore(out + 1, (unsigned int)(S.arena_version >> 32), mode);
                }
                for (int i = threadIdx.x; i < kk; i += blockDim.x) {
                    uint4 e = make_uint4(0u, 0u, 0u, 0u);  // no such entry: length 0 (the client asks again)
                    if constexpr (Vec<T>::INT8) {
                        e = result_entry(bell_results(cand), vals[i], seen());  // read with the row (rescore_share)
                    } else {
                        int r = vals[i];
                        if (r >= 0 && r < S.arena_rows)
                            e = (mode & BELL_ARENA_DEVICE) ? __ldcg(reinterpret_cast<const uint4*>(S.arena) + r)
                                                           : hload4(reinterpret_cast<const void*>(S.arena + 16ull * r), mode);
                    }
                    unsigned int* o = out + 2 + 4 * i;
                    hstore(o, e.x, mode);
                    hstore(o + 1, e.y, mode);
                    hstore(o + 2, e.z, mode);
                    hstore(o + 3, e.w, mode);
                }
            } else {
                for (int i = threadIdx.x; i < kk; i += blockDim.x) {
                    unsigned int g = 0;  // no such entry: a generation no row has (the client asks again)
                    if constexpr (Vec<T>::INT8) {
                        g = result_entry(bell_results(cand), vals[i], seen()).w;
                    } else {
                        int r = vals[i];
                        if (r >= 0 && r < S.arena_rows)
                            g = (mode & BELL_ARENA_DEVICE) ? __ldcg(reinterpret_cast<const unsigned int*>(S.arena + 16ull * r + 12))
                                                           : hload(reinterpret_cast<const unsigned int*>(S.arena + 16ull * r + 12), mode);
                    }
                    hstore(out + i, g, mode);
                }
            }
            // The response words with the blob, behind the same fence: each thread's system fence
            // orders its own stores before the barrier, and the state word is stored after it.
            // (Written after a first fence and then fenced again, they cost a second wait for
            // the posted stores to drain.)
            if (threadIdx.x == 0) {
                unsigned int* w = reinterpret_cast<unsigned int*>(sb);
                hstore(w + W_RESP_SEQ, __ldcg(bell + 4), mode);
                hstore(w + W_RESP_SEQ + 1, __ldcg(bell + 5), mode);
                hstore(w + W_STATUS, 0u, mode);  // OK
                hstore(w + W_N_RESULTS, (unsigned int)kk, mode);
                hstore(w + W_RESP_LEN, entries ? 8u + 16u * kk : 4u * kk, mode);
                hstore(w + W_RESP_LEN + 1, 0u, mode);
                hstore(w + W_RESP_FLAGS, (unsigned int)(RESP_ARENA_DOCS | (entries ? RESP_ARENA_ENTRIES : 0)), mode);
                hstore(w + W_RESP_FLAGS + 1, 0u, mode);
            }
            __threadfence_system();
            __syncthreads();
            if (threadIdx.x == 0) {
                unsigned int* w = reinterpret_cast<unsigned int*>(sb);
                hstore(w, (unsigned int)ST_RESPONSE, mode);  // last
                if (mode & BELL_FENCE) __threadfence_system();
                hstore(&ctl_->stamp[3], global_ns(), mode);
                hstore(&ctl_->served, (u64)(atomicAdd(bell + 6, 1u) + 1u), mode);  // posted: no PCIe read
                atomicExch(bell + 1, seen());  // done: block 0 may take the next request
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// topk_scores<QB=1>: per-query top-k over a precomputed scores matrix (the GEMM path).
//   grid: (G, B); scores[b][row] for row < n_rows, leading dimension sld.

template <int METRIC>
__global__ void __launch_bounds__(KALOS_BLOCK)
topk_scores(const float* __restrict__ scores, int sld, const int* __restrict__ ns,
            const float* __restrict__ sqnorm, const float* __restrict__ rowscale,
            const Params* __restrict__ p, int buf,
            float* __restrict__ scratch_k, int* __restrict__ scratch_v,
            unsigned int* __restrict__ counters) {
    extern __shared__ float smem[];
    __shared__ int s_cnt[1];
    __shared__ float s_thr[1];
    Cands<1> c{smem, reinterpret_cast<int*>(smem + buf), s_cnt, s_thr, buf};
    const int q = blockIdx.y;
    const int k = p->k, n = p->n_rows, my_ns = p->ns_id;
    const unsigned char* mask = p->mask;
    const float qn2 = p->qnorm2[q];
    if (threadIdx.x == 0) { s_cnt[0] = 0; s_thr[0] = neg_inf(); }
    __syncthreads();
    const float* srow = scores + (size_t)q * sld;
    const int per_round = MERGE_UNROLL * blockDim.x;
    const int stride = gridDim.x * per_round;
    for (int r0 = blockIdx.x * per_round; r0 < n; r0 += stride) {
        float s[MERGE_UNROLL];
        bool ok[MERGE_UNROLL];
#pragma unroll
        for (int u = 0; u < MERGE_UNROLL; u++) {
            int row = r0 + u * blockDim.x + threadIdx.x;
            ok[u] = row < n && (my_ns == NS_ANY || ns[row] == my_ns) && (mask == nullptr || mask[row]);
            s[u] = ok[u] ? srow[row] : 0.f;
        }
#pragma unroll
        for (int u = 0; u < MERGE_UNROLL; u++) {
            if (!ok[u]) continue;
            int row = r0 + u * blockDim.x + threadIdx.x;
            float v = s[u];
            if (rowscale != nullptr) v *= rowscale[row];
            if (METRIC == METRIC_L2) v = -sqrtf(fmaxf(qn2 + sqnorm[row] - 2.f * v, 0.f));
            c.offer(0, v, row);
        }
        __syncthreads();
        c.make_room(k, per_round, buf);
    }
    // scratch layout: [q][block][k]
    float* sk = scratch_k + ((size_t)q * gridDim.x + blockIdx.x) * k;
    int* sv = scratch_v + ((size_t)q * gridDim.x + blockIdx.x) * k;
    finish_block(c, k, 1, sk, sv, k);
    // last block of this query's row of blocks merges
    __shared__ bool is_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int t = atomicAdd(&counters[q], 1u);
        is_last = (t == gridDim.x - 1);
        if (is_last) counters[q] = 0;
    }
    __syncthreads();
    if (is_last) {
        __threadfence();
        const Params* pp = p;
        if (threadIdx.x == 0) { c.cnt[0] = 0; c.thr[0] = neg_inf(); }
        __syncthreads();
        const float* bk = scratch_k + (size_t)q * gridDim.x * k;
        const int* bv = scratch_v + (size_t)q * gridDim.x * k;
        float bound = seed_bound(bk + (k - 1), k, gridDim.x);
        int total = gridDim.x * k;
        for (int base = 0; base < total; base += MERGE_UNROLL * blockDim.x) {
            float sc[MERGE_UNROLL];
            int r[MERGE_UNROLL];
#pragma unroll
            for (int u = 0; u < MERGE_UNROLL; u++) {
                int i = base + u * blockDim.x + threadIdx.x;
                r[u] = i < total ? __ldcg(bv + i) : -1;
                sc[u] = i < total ? __ldcg(bk + i) : 0.f;
            }
#pragma unroll
            for (int u = 0; u < MERGE_UNROLL; u++)
                if (r[u] >= 0 && sc[u] >= bound) c.offer(0, sc[u], r[u]);
            __syncthreads();
            if (c.cnt[0] > c.buf - MERGE_UNROLL * (int)blockDim.x) compact(c.key, c.val, &c.cnt[0], &c.thr[0], k, c.buf);
        }
        compact(c.key, c.val, &c.cnt[0], &c.thr[0], k, c.buf);
        int* orow = pp->out_rows[q];
        float* oscore = pp->out_scores[q];
        for (int i = threadIdx.x; i < k; i += blockDim.x) {
            bool have = i < c.cnt[0];
            orow[i] = have ? c.val[i] : -1;
            oscore[i] = have ? c.key[i] : neg_inf();
        }
        final_fence();
    }
}

// ------------------------------------------------------------------------------------------
// The GEMM path's threshold top-k: three small kernels over the scores matrix instead of
// per-block candidate buffers (which cost ~700 us for 64 queries x 1M rows in topk_scores).
//
//   tau_scores     one block per query: the k-th best eligible score among S sampled rows
//                  (radix select). No row outside the answer can beat it, so it is a safe
//                  threshold (-inf when the sample holds fewer than k eligible rows).
//   filter_scores  streams the matrix once; appends each eligible (score >= tau, ties kept)
//                  to the query's candidate list (at most `cap`; the count keeps counting).
//   select_cands   one block per query: finds its k-th candidate by radix select, sorts only
//                  the candidates at or above it, and writes the best k into the slot. A
//                  list that overflowed sets *overflow and writes nothing: the host then runs
//                  topk_scores for that batch.
// Choosing S so that k * n / S is about cap / 4 leaves the expected list well inside cap.

// The threshold's sample: S rows (S a power of two) as S / SPREAD_RUN runs of SPREAD_RUN
// consecutive rows spread over the n rows, where it was the first S rows until session 56.
// Any eligible rows give a safe threshold; spread ones give a useful one where a scope is not
// spread evenly by row: a namespace written after another (the first S rows were all the
// other's, so tau was -inf, every one of its rows a candidate, the list overflowed and the
// batch took the exact path: 7.6 ms for 64 queries in half of 1M rows against 0.92 ms
// unscoped, S56-2). The rows' whole runs of SPREAD_RUN ("chunks") are cut into S / SPREAD_RUN
// strata, the last ending at the last whole chunk, and run j is a chunk of stratum j picked
// by a hash of j: evenly spaced runs would all fall in one of two namespaces written in turn
// in blocks of 32 or 64 rows. Each of mma_filter's warp tiles (16 * MT rows) lies in one run,
// so its dump of the sample reads rows as contiguously as before. Sample index i is row i
// when S >= n, or SPREAD_RUN does not divide S (the host's samples are powers of two of at
// least 1,024 rows, or every row).
// tests/unit/test_spread_sample.py compiles the lines between the markers on the host.
// spread: begin
#ifndef KALOS_MMA_MT
#define KALOS_MMA_MT 0  // m16 tiles per mma_filter warp tile; 0: per NT (mma_filter's variants, below)
#endif
#define SPREAD_RUN (KALOS_MMA_MT > 2 ? 16 * KALOS_MMA_MT : 32)
// The first row of run j of the S-row sample of n rows (SPREAD_RUN <= S < n; 32-bit exact:
// with chunks = q * runs + r, j * chunks / runs = j * q + j * r / runs, j and r below runs).
__host__ __device__ __forceinline__ int spread_start(int j, int S, int n) {
    const int runs = S / SPREAD_RUN, chunks = n / SPREAD_RUN;  // chunks >= runs
    const int q = chunks / runs, r = chunks % runs;
    const int lo = j * q + j * r / runs, hi = (j + 1) * q + (j + 1) * r / runs;  // stratum j: [lo, hi)
    unsigned h = (unsigned)j + 0x9e3779b9u;  // murmur3's finalizer (a multiplicative hash's low
    h ^= h >> 16;                            // bits follow j nearly linearly: at some n one of two
    h *= 0x85ebca6bu;                        // namespaces written in turn in blocks of 256 or 1024
    h ^= h >> 13;                            // rows got 3-13% of the runs, in review)
    h *= 0xc2b2ae35u;
    h ^= h >> 16;
    return (lo + (int)(h % (unsigned)(hi - lo))) * SPREAD_RUN;
}
// (S % SPREAD_RUN: a variant's runs of 48 rows do not divide S; those take the first S rows)
__host__ __device__ __forceinline__ bool spread(int S, int n) { return S < n && S >= SPREAD_RUN && S % SPREAD_RUN == 0; }
__host__ __device__ __forceinline__ int spread_row(int i, int S, int n) {
    return spread(S, n) ? spread_start(i / SPREAD_RUN, S, n) + i % SPREAD_RUN : i;
}
// spread: end
#define SPREAD_RUNS_MAX 512  // tau_scores' table of run starts (TAU_SAMPLE_MAX / 32 in sidecar/index_gpu.py)

template <int METRIC>
__device__ __forceinline__ bool score_at(const float* srow, int col, int n, const int* ns, int my_ns,
                                         const unsigned char* mask, const float* sqnorm, float qn2,
                                         float* out) {
    if (col >= n || (my_ns != NS_ANY && ns[col] != my_ns) || (mask != nullptr && !mask[col])) return false;
    float v = srow[col];
    if (METRIC == METRIC_L2) v = -sqrtf(fmaxf(qn2 + sqnorm[col] - 2.f * v, 0.f));
    *out = v;
    return true;
}

// grid (n_queries), block KALOS_BLOCK, dynamic smem: S * 8 bytes (S a power of two).
// dumped: scores holds the sample's S scores per query (mma_filter's dump, by sample index),
// else a score per row (the cuBLAS path's matrix).
template <int METRIC>
__global__ void __launch_bounds__(KALOS_BLOCK)
tau_scores(const float* __restrict__ scores, int sld, const int* __restrict__ ns,
           const float* __restrict__ sqnorm, const Params* __restrict__ p, int S,
           float* __restrict__ tau, int dumped) {
    extern __shared__ float smem[];
    float* key = smem;
    const int q = blockIdx.x, k = p->k, n = p->n_rows;
    const float* srow = scores + (size_t)q * sld;
    __shared__ int s_elig;
    if (threadIdx.x == 0) s_elig = 0;
    __syncthreads();
    int mine = 0;
    // the runs' first rows, once per block (a few integer divisions each)
    __shared__ int s_start[SPREAD_RUNS_MAX];
    const bool spread_ = spread(S, n), table = S / SPREAD_RUN <= SPREAD_RUNS_MAX;
    if (spread_ && table)
        for (int j = threadIdx.x; j < S / SPREAD_RUN; j += blockDim.x) s_start[j] = spread_start(j, S, n);
    __syncthreads();
    for (int i = threadIdx.x; i < S; i += blockDim.x) {
        const int row = !spread_ ? i : table ? s_start[i / SPREAD_RUN] + i % SPREAD_RUN : spread_row(i, S, n);
        float v;
        bool ok = score_at<METRIC>(srow + (dumped ? i - row : 0), row, n, ns, p->ns_id, p->mask, sqnorm,
                                   p->qnorm2[q], &v);
        key[i] = ok ? v : neg_inf();
        mine += ok;
    }
    atomicAdd(&s_elig, mine);
    __syncthreads();
    const bool enough = s_elig >= k;  // block-uniform: every thread takes the same branch
    float t = enough ? block_kth_largest(key, S, k) : neg_inf();
    if (threadIdx.x == 0) tau[q] = t;
}

// grid (G, n_queries), block KALOS_BLOCK
template <int METRIC>
__global__ void __launch_bounds__(KALOS_BLOCK)
filter_scores(const float* __restrict__ scores, int sld, const int* __restrict__ ns,
              const float* __restrict__ sqnorm, const Params* __restrict__ p,
              const float* __restrict__ tau, float* __restrict__ ck, int* __restrict__ cv,
              int* __restrict__ ccount, int cap) {
    const int q = blockIdx.y, n = p->n_rows, my_ns = p->ns_id;
    const unsigned char* mask = p->mask;
    const float t = tau[q], qn2 = p->qnorm2[q];
    const float* srow = scores + (size_t)q * sld;
    const int per_round = MERGE_UNROLL * blockDim.x;
    for (int c0 = blockIdx.x * per_round; c0 < n; c0 += gridDim.x * per_round) {
        float v[MERGE_UNROLL];
        bool ok[MERGE_UNROLL];
#pragma unroll
        for (int u = 0; u < MERGE_UNROLL; u++)  // all loads in flight before any is used
            ok[u] = score_at<METRIC>(srow, c0 + u * blockDim.x + threadIdx.x, n, ns, my_ns, mask,
                                     sqnorm, qn2, &v[u]);
#pragma unroll
        for (int u = 0; u < MERGE_UNROLL; u++) {
            if (ok[u] && v[u] >= t) {
                int pos = atomicAdd(&ccount[q], 1);
                if (pos < cap) {
                    ck[(size_t)q * cap + pos] = v[u];
                    cv[(size_t)q * cap + pos] = c0 + u * blockDim.x + threadIdx.x;
                }
            }
        }
    }
}

// Candidates select_cands gathers at or above the k-th (k of them, plus ties): it sorts only
// these. More ties than this: it sorts the whole list instead.
#define SELECT_GATHER 2048

// grid (n_queries), block KALOS_BLOCK, dynamic smem: (cap + SELECT_GATHER) * 8 bytes (cap a
// power of two)
template <int METRIC>
__global__ void __launch_bounds__(KALOS_BLOCK)
select_cands(const float* __restrict__ ck, const int* __restrict__ cv, int* __restrict__ ccount,
             int cap, const Params* __restrict__ p, int* overflow) {
    extern __shared__ float smem[];
    __shared__ int s_n;
    const int q = blockIdx.x, k = p->k;
    const int m = ccount[q];
    if (m > cap) {  // every block reads its own count; the list is not usable
        if (threadIdx.x == 0) { *overflow = 1; ccount[q] = 0; __threadfence_system(); }
        return;
    }
    const int pw = next_pow2(m < 2 ? 2 : m);
    float* key = smem;
    int* val = reinterpret_cast<int*>(smem + pw);
    float* gkey = smem + 2 * pw;  // the gathered candidates (SELECT_GATHER pairs)
    int* gval = reinterpret_cast<int*>(gkey + SELECT_GATHER);
    for (int i = threadIdx.x; i < pw; i += blockDim.x) {
        bool have = i < m;
        key[i] = have ? ck[(size_t)q * cap + i] : neg_inf();
        val[i] = have ? cv[(size_t)q * cap + i] : 0x7fffffff;
    }
    if (threadIdx.x == 0) s_n = 0;
    __syncthreads();
    const float* okey = key;
    const int* oval = val;
    if (m > 2 * k && m > 64) {  // block-uniform: the k-th by radix select, then sort what is at or above it
        const float t = block_kth_largest(key, m, k);
        for (int i = threadIdx.x; i < m; i += blockDim.x) {
            if (key[i] >= t) {
                int at = atomicAdd(&s_n, 1);
                if (at < SELECT_GATHER) { gkey[at] = key[i]; gval[at] = val[i]; }
            }
        }
        __syncthreads();
        const int g = s_n;
        if (g <= SELECT_GATHER) {
            const int gp = next_pow2(g < 2 ? 2 : g);
            for (int i = g + threadIdx.x; i < gp; i += blockDim.x) { gkey[i] = neg_inf(); gval[i] = 0x7fffffff; }
            __syncthreads();
            bitonic_desc(gkey, gval, gp);
            okey = gkey;
            oval = gval;
        } else {
            bitonic_desc(key, val, pw);  // ties beyond the gather area: the whole list
        }
    } else {
        bitonic_desc(key, val, pw);
    }
    int* orow = p->out_rows[q];
    float* oscore = p->out_scores[q];
    for (int i = threadIdx.x; i < k; i += blockDim.x) {
        bool have = i < m;
        orow[i] = have ? oval[i] : -1;
        oscore[i] = have ? okey[i] : neg_inf();
    }
    if (threadIdx.x == 0) ccount[q] = 0;  // ready for the next batch
    final_fence();
}

// ------------------------------------------------------------------------------------------
// mma_filter<NT, METRIC>: the batched path's fused scan for float16 rows. Tensor cores
// (mma.sync m16n8k16, float32 accumulation) score each row against up to 8 * NT queries, and
// each score is compared at once with its query's threshold tau[q] (tau_scores); what reaches
// it is appended to the query's candidate list, as filter_scores does from a score matrix, for
// select_cands. The rows are read once and no score matrix is written (the cuBLAS path wrote
// 4 bytes per row and query, read them back in filter_scores, and paid host gaps around the
// GEMM).
//   grid (G), block KALOS_BLOCK; dynamic shared memory: 8 * NT * lds halves (the queries).
//
// nrows < 0: rows [0, p->n_rows) (prep's count, so one captured graph serves any count). With
// dump != nullptr it scores the sample of nrows rows (spread_row over p->n_rows, whole warp
// tiles) and writes the raw dot products to dump[q * dump_ld + i] for sample index i instead:
// the sample tau_scores takes the thresholds from.
//
// Layout. Each warp takes tiles of 16 * MT rows in a grid stride. Lane (g = lane / 4,
// t = lane % 4) loads 16 bytes (8 halves) of rows g, g+8 (and g+16, g+24) at column
// kc = k0 + 8t, so a warp's load covers 64 contiguous bytes of 8 rows. A dot product sums over k in any order, so these
// 8 halves feed two k16 mma steps with the k positions of A (rows) and B (queries) permuted
// the same way: step s uses halves 4s, 4s+1 where the instruction expects k = 2t, 2t+1 and
// halves 4s+2, 4s+3 where it expects 2t+8, 2t+9. The lane holding B's column g of n-tile j
// loads the same 8 halves of query 8j + g from shared memory; lds (ld padded to 32 mod 64
// halves) puts the 8 lanes of each 128-byte phase on distinct banks. Accumulator (m-tile, j):
// c0, c1 = row g, queries 8j + 2t, +1; c2, c3 = row g + 8 (PTX ISA, m16n8k16 f32 layout).
// m16n8k16 needs sm_80: on older devices the module still compiles (the host never launches
// mma_filter there, see GpuIndex.mma_ok) and the kernel traps if it ever runs.
//
// Variants for benchmarks/mma_variants.py (defaults: what the sidecar runs): KALOS_MMA_STEPS
// (32-half steps per round of loads), KALOS_MMA_MT (m16 tiles per warp tile), KALOS_MMA_MINB
// (blocks per SM the compiler must fit: the register cap), KALOS_MMA_PROBE (1: no mma, the
// loads feed a cheap sum; 2: no loads, the mma run on register values; both give wrong answers).
#ifndef KALOS_MMA_STEPS
#define KALOS_MMA_STEPS 2
#endif
#ifndef KALOS_MMA_MINB
#define KALOS_MMA_MINB 2
#endif
#ifndef KALOS_MMA_PROBE
#define KALOS_MMA_PROBE 0
#endif
__device__ __forceinline__ void mma16816(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
#if KALOS_MMA_PROBE & 1
    c[0] += __uint_as_float((a0 ^ a1 ^ a2 ^ a3 ^ b0 ^ b1) & 0x3f800000u);
#elif !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    __trap();
#endif
}

template <int NT, int METRIC, bool DUMP = false>
__global__ void __launch_bounds__(KALOS_BLOCK, KALOS_MMA_MINB)
mma_filter(const __half* __restrict__ data, int ld, int lds, int nrows, const int* __restrict__ ns,
           const float* __restrict__ sqnorm, const Params* __restrict__ p, const __half* __restrict__ qh,
           const float* __restrict__ tau, float* __restrict__ ck, int* __restrict__ cv,
           int* __restrict__ ccount, int cap, float* __restrict__ dump, int dump_ld) {
    extern __shared__ uint4 mma_smem[];
    __half* qs = reinterpret_cast<__half*>(mma_smem);
    __shared__ float s_tau[8 * NT], s_qn2[8 * NT];
    const int nq = p->n_queries, my_ns = p->ns_id;
    if (nrows < 0) nrows = p->n_rows;
    const unsigned char* mask = p->mask;
    const int cpr = ld / 8;  // 16-byte chunks per row (ld is a multiple of 8)
    for (int i = threadIdx.x; i < 8 * NT * cpr; i += blockDim.x) {
        const int q = i / cpr, c = i - q * cpr;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (q < nq) v = *reinterpret_cast<const uint4*>(qh + (size_t)q * ld + 8 * c);
        *reinterpret_cast<uint4*>(qs + (size_t)q * lds + 8 * c) = v;
    }
    if (threadIdx.x < 8 * NT) {
        const int q = threadIdx.x;
        s_tau[q] = (dump == nullptr && q < nq) ? tau[q] : 0.f;
        s_qn2[q] = q < nq ? p->qnorm2[q] : 0.f;
    }
    __syncthreads();

    // m16 tiles per warp tile: with two (32 rows), each query fragment loaded from shared
    // memory serves both. Measured alone at 1M rows on the H200 (benchmarks/mma_variants.py,
    // S7-1), two tiles won only for 17-32 queries (NT 4: 422 / 430 us for 24 / 32 queries
    // against 551 / 562 with one); one tile won for 8 / 16 queries (381 / 390 against 391 /
    // 403 us) and for 64 (590 against 632).
    constexpr int MT = KALOS_MMA_MT ? KALOS_MMA_MT : (NT == 4 ? 2 : 1), H = 2 * MT;
    static_assert(SPREAD_RUN % (16 * MT) == 0, "a warp tile of the sample must lie in one run");
    // DUMP: the sample's runs spread over prep's rows (a build of its own: the spread's
    // arithmetic in the pass took NT 2's registers from 64 to 68-74, a block per SM fewer)
    const int n_all = DUMP ? p->n_rows : 0;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
    const int wpb = blockDim.x / 32;
    const int tiles = (nrows + 16 * MT - 1) / (16 * MT);
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    const uint4* rows16 = reinterpret_cast<const uint4*>(data);
    for (int tile = blockIdx.x * wpb + warp; tile < tiles; tile += gridDim.x * wpb) {
        const int r0 = tile * 16 * MT;
        const int s0 = DUMP ? spread_row(r0, nrows, n_all) : r0;  // the tile's first row (in one run)
        bool rok[H];
#pragma unroll
        for (int h = 0; h < H; h++) rok[h] = r0 + g + 8 * h < nrows;
        const uint4* rp = rows16 + (size_t)(s0 + g) * cpr;  // row g of the tile; row g + 8h at + 8h * cpr
        float acc[MT][NT][4];
#pragma unroll
        for (int m = 0; m < MT; m++)
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[m][j][e] = 0.f;
        // Rounds of S steps of 32 halves: every load of a round is issued before its first
        // mma. Measured on one H200 at 1M rows (docs/gpu-notes.md, S6-3 ... S6-5), the whole
        // batched graph for 8 / 24 / 64 queries took 428 / 475 / 728 us this way, against
        // 543 / 597 / 829 us with a software pipeline that keeps one step's loads in flight
        // while the previous step computes; rounds of 4 steps for up to 16 queries took 502 us
        // for 8.
        constexpr int S = KALOS_MMA_STEPS;
        for (int k0 = 0; k0 < ld; k0 += 32 * S) {  // warp-uniform
            uint4 a[S][H];
#pragma unroll
            for (int u = 0; u < S; u++) {
                const int kc = k0 + 32 * u + 8 * t;
#pragma unroll
                for (int h = 0; h < H; h++)
                    a[u][h] = (KALOS_MMA_PROBE & 2) ? make_uint4(kc, h, t, g)
                                                    : (kc < ld && rok[h]) ? __ldg(rp + (size_t)8 * h * cpr + kc / 8) : zero;
            }
#pragma unroll
            for (int u = 0; u < S; u++) {
                if (k0 + 32 * u >= ld) break;  // warp-uniform
                const int kc = k0 + 32 * u + 8 * t;
#pragma unroll
                for (int j = 0; j < NT; j++) {
                    const uint4 b = kc < ld ? *reinterpret_cast<const uint4*>(qs + (size_t)(8 * j + g) * lds + kc) : zero;
#pragma unroll
                    for (int m = 0; m < MT; m++)
                        mma16816(acc[m][j], a[u][2 * m].x, a[u][2 * m + 1].x, a[u][2 * m].y, a[u][2 * m + 1].y, b.x, b.y);
#pragma unroll
                    for (int m = 0; m < MT; m++)
                        mma16816(acc[m][j], a[u][2 * m].z, a[u][2 * m + 1].z, a[u][2 * m].w, a[u][2 * m + 1].w, b.z, b.w);
                }
            }
        }
#pragma unroll
        for (int h = 0; h < H; h++) {
            const int row = r0 + g + 8 * h;
            if (!rok[h]) continue;
            if (dump != nullptr) {
#pragma unroll
                for (int j = 0; j < NT; j++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int q = 8 * j + 2 * t + e;
                        if (q < nq) dump[(size_t)q * dump_ld + row] = acc[h >> 1][j][2 * (h & 1) + e];
                    }
                continue;
            }
            if ((my_ns != NS_ANY && ns[row] != my_ns) || (mask != nullptr && !mask[row])) continue;
            const float sqn = METRIC == METRIC_L2 ? sqnorm[row] : 0.f;
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int q = 8 * j + 2 * t + e;
                    float s = acc[h >> 1][j][2 * (h & 1) + e];
                    if (METRIC == METRIC_L2) s = -sqrtf(fmaxf(s_qn2[q] + sqn - 2.f * s, 0.f));
                    if (q < nq && s >= s_tau[q]) {
                        const int pos = atomicAdd(&ccount[q], 1);
                        if (pos < cap) {
                            ck[(size_t)q * cap + pos] = s;
                            cv[(size_t)q * cap + pos] = row;
                        }
                    }
                }
        }
    }
}

// ------------------------------------------------------------------------------------------
// carousel_topk<NT, METRIC>: a scan that never ends, which queries board and leave (a GPU
// sidecar's crowd with KALOS_CAROUSEL=1 or direct, off by default: sidecar/carousel.py and
// crowd.py; benchmarks/carousel_probe.py in process). Float16 rows, top-k up to CAR_KMAX, up to
// 8 * NT queries in flight at once.
//
// Why: with 32 client processes at 1M rows the sidecar's batches settle into two cohorts that
// each pay a whole pass (~385 µs): a client answered at the end of one pass cannot be in the
// next, which was launched behind it, so every recall costs two passes and 32 clients cannot
// pass 32 / (2 x 385 µs) = ~41.5k recalls/s (gpu-notes, sessions 26-32). Here the rows are read
// round and round by a resident grid, and a query joins wherever the scan is: it is answered
// after one full turn from its boarding, so a client's cycle is one pass plus its own return.
// Session 28's sweep (the same idea driven by the host's loop, 4 row ranges) lost: its queries
// boarded only at range boundaries and each range was a launch from Python. Here nothing of
// the host is on the path: block 0 takes requests from the slots, every other block boards them
// at its own next step, and once all have finished a query's turn block 0 answers it.
//
// Blocks. Block 0 is the conductor: it polls the request slots (host memory, mapped) for
// state CAR_REQUEST and installs each in a free position (its query as halves, normalized for
// cosine, in pos_q; its k, slot, namespace, seq and boarding time in pinfo; then gen[p] + 1),
// and frees a position once it is answered. Blocks 1 .. G own fixed, contiguous ranges of the rows in tiles
// of 16 * MT rows and go round their range a step at a time (each warp one tile per step). At a
// step's start a block boards every position whose gen has moved (loads its query into shared
// memory) and gives it the whole turn: `steps` steps, after which it has scored every row of
// the range once, wherever it boarded. Positions are independent of each other and of the
// other blocks: no grid-wide barrier anywhere.
//
// The top-k. Each block keeps, per position, a list of (score, row) packed as sel_pack (one
// u64: larger is better, ties by smaller row) in device memory, `lists`, and a threshold in
// shared memory: the k-th best the list has held (-inf at boarding). A row scoring at or above
// the threshold is appended. After a step a list that might not hold one more step's rows
// (CAR_CAP - CAR_STEP_ROWS) is cut to its best k by one warp, which raises the threshold; at
// the end of the turn the list's best k go to res (for p: [G][k], dense) and the block adds 1 to
// done[p]. When done[p] reaches G the conductor (the clerk, KALOS_CAR_CLERK) merges every
// block's best k (car_merge) and writes rows, scores, words and state CAR_DONE into the slot
// (car_write).
// A block's best k over its range hold the global top-k's members from that range, so the
// top-k of every block's best k is exact (ties: the smaller row first, as the other paths).
// Why the conductor and not the block that finishes last (sessions 34-35's design, still
// KALOS_CAR_CLERK=0): a block merging (~8 µs) is late for every other position aboard, so it
// finishes their turns last as well and merges those too. S36-1 found one block of 263 doing
// 51,678 of 51,682 merges, and turns of 874 µs with 32 aboard, against 648 with the clerk.
//
// Memory order. The conductor writes pos_q and pinfo, fences, then bumps gen[p] (atomic); a
// block reads gen with an acquire load, then pos_q and pinfo through L2 (__ldcg: L1 may hold
// the position's previous query). A block's warps write res; after a barrier one thread adds
// to done[p] with a release reduction (the barrier and the release carry the other warps'
// writes); the conductor reads done (volatile), fences (the acquire), then reads res through
// L2, answers (the state released at system scope after the results), sets done[p] = 0 and
// may install the next query there in a later round (its fence before the gen orders the
// reset). gen[p] moves only when every block has finished the position's previous query, so
// each block boards every query once. (Full fences, __threadfence, cost 1-2 µs each mid-scan:
// S36-2's profile; each step of a block used to take two or three.) A request: its client (or
// the sidecar's lane) stores the query and the words before the state CAR_REQUEST (x86-64
// keeps stores in order); the conductor's poll loads the states with ld.relaxed.sys (a
// strong load: the mode's ld.cv is a weak one, which no fence turns into an acquire), and a
// round that sees a request and has a free position fences (fence.acq_rel.sys: with that
// load, an acquire) before the barrier after which the boarding warps read the query and the
// words (KALOS_CAR_ACQUIRE, default 1; 0: the poll by the mode's ld.cv and no fence, session
// 37's kernel, for an A/B of the cost).
//
// Slot (host memory, slot_bytes apart from slot0; little endian u32 words):
//   [0] state: CAR_REQUEST (the client, after everything else) -> CAR_TAKEN (conductor) ->
//       CAR_DONE (the answering block: the conductor, or with KALOS_CAR_CLERK=0 the last scanning
//       block) or CAR_ERROR (conductor), after the results and words below
//   [1] k   [2] namespace id (NS_ANY: every row)   [3] seq (echoed into [5])
//   [4] results (out)   [5] seq (out)   [6] ns on the GPU from boarding to answer (out)
//   float32 query[dim] at byte 32 (16-byte aligned); int32 rows[k] at rows_off, float32
//   scores[k] at scores_off (best first; past the results: -1 and -inf).
// A request is refused (CAR_ERROR, 0 results) when its k is outside [1, CAR_KMAX], its query is
// not finite (or, for ip and L2, holds a value float16 cannot: |x| > 65504), or it names a
// namespace and the launch has no namespace array.
// hctl (host memory): [0] stop (the host sets it; the conductor then tells the blocks and every
// block returns; positions in flight are abandoned, their slots left CAR_TAKEN), [2..3] the
// number of answers (u64, written by the conductor as it frees their positions), [4] how many
// scanning blocks have started (the conductor's copy: the host checks that every block is
// resident).
// dctl (device memory, zeroed before the launch): [0] stop seen, [1, 1 + P) gen, [1 + P, 1 + 2P)
// done, [1 + 2P] scanning blocks started. pinfo (device, [P][CAR_PINFO] ints): k, slot,
// namespace, |q|^2 bits, seq, boarding time (GPU clock, two words).
#define CAR_IDLE 0u
#define CAR_REQUEST 1u
#define CAR_TAKEN 2u
#define CAR_DONE 3u
#define CAR_ERROR 4u
#define CAR_HEAD_BYTES 32
#define CAR_PINFO 8                      // ints per position in pinfo
#ifndef CAR_KMAX
#define CAR_KMAX 32                      // largest k (one result per lane of a warp)
#endif
#define CAR_STEP_ROWS (KALOS_BLOCK / 32 * 32)  // rows a block scores per step at most (MT = 2)
#define CAR_CAP (2 * CAR_STEP_ROWS + CAR_KMAX)  // a list's room (u64 each; a multiple of 32: one chunk of car_best)
#ifndef KALOS_CAR_MINB
#define KALOS_CAR_MINB 2
#endif
// Who merges a finished turn's lists and answers: 0, the scanning block that finished it last;
// 1, the conductor (the clerk). With 0 the merging block is late for every other position
// aboard while it merges, so it tends to finish their turns last too and merge them as well:
// a convoy whose cost grows with the positions aboard (benchmarks/carousel_probe.py
// --profile counts the merges per block).
#ifndef KALOS_CAR_CLERK
#define KALOS_CAR_CLERK 1
#endif
// The conductor's poll an acquire (1: strong loads and a fence in a round that boards, the
// memory-order note above; 0: session 37's weak poll, for an A/B of the cost).
#ifndef KALOS_CAR_ACQUIRE
#define KALOS_CAR_ACQUIRE 1
#endif
// A turn's closing selection over a short list (at most 64 entries: the usual case once the
// threshold has risen) by car_best<2> instead of car_best<CAR_CAP / 32>: k rounds of 3 compares
// instead of 18 (1: on; 0: the long form always, for an A/B).
#ifndef KALOS_CAR_SHORT
#define KALOS_CAR_SHORT 1
#endif
// Diagnostics (-DKALOS_CAR_PROFILE; benchmarks/carousel_probe.py --profile): per block, thread
// 0's clock64 cycles by stage and counts of events, summed in shared memory and stored after
// every step or round into car_prof[block][CAR_PROF_W]. The CP_* names index a scanning
// block's row; the conductor's (block 0) uses CC_*.
#define CAR_PROF_W 16
enum { CP_STEPS, CP_START, CP_IDLE, CP_SCAN, CP_END, CP_CUT, CP_DONE, CP_MERGE, CP_NMERGE, CP_NCUT, CP_NFINAL,
       CP_LISTN, CP_ABOARD, CP_NIDLE, CP_SMID, CP_TILES };
enum { CC_ROUNDS, CC_POLL, CC_MERGE, CC_BOARD, CC_NBOARD, CC_NMERGE, CC_SELECT };
#ifdef KALOS_CAR_PROFILE
__device__ unsigned long long car_prof[1024 * CAR_PROF_W];
#define CAR_STAMP(t) const long long t = clock64()
#define CAR_PROF(i, v) do { if (threadIdx.x == 0) s_prof[i] += (unsigned long long)(v); } while (0)
#define CAR_FLUSH() do { if (threadIdx.x == 0 && blockIdx.x < 1024) \
    for (int i_ = 0; i_ < CAR_PROF_W; i_++) car_prof[blockIdx.x * CAR_PROF_W + i_] = s_prof[i_]; } while (0)
#else
#define CAR_STAMP(t)
#define CAR_PROF(i, v) do {} while (0)
#define CAR_FLUSH() do {} while (0)
#endif
static_assert(CAR_CAP % 32 == 0 && CAR_KMAX <= 32, "car_best takes a list in one chunk of CAR_CAP / 32 words per lane");

__device__ __forceinline__ u64 warp_max64(u64 x) {
    unsigned int hi = (unsigned int)(x >> 32);
#if __CUDA_ARCH__ >= 800
    const unsigned int mh = __reduce_max_sync(0xffffffffu, hi);
    const unsigned int ml = __reduce_max_sync(0xffffffffu, hi == mh ? (unsigned int)x : 0u);
#else
    unsigned int mh = hi;
    for (int o = 16; o > 0; o >>= 1) mh = max(mh, __shfl_xor_sync(0xffffffffu, mh, o));
    unsigned int ml = hi == mh ? (unsigned int)x : 0u;
    for (int o = 16; o > 0; o >>= 1) ml = max(ml, __shfl_xor_sync(0xffffffffu, ml, o));
#endif
    return ((u64)mh << 32) | ml;
}

// The best k (<= 32) of the n distinct words src[0, n) (0: no entry, below every real one), by
// one warp: lane r returns the r-th best (0 past the last). The words come in chunks of 32 x R,
// each lane's share of a chunk held in registers with one of the best k so far: one pass of
// loads per chunk (L2: through L2, for words another block wrote), then k rounds of R + 1
// compares and one warp max. (Loading the words again each round, as a first version did, put
// k rounds of dependent loads on the path: a few µs for a block's list of ~512 words, and
// 45-75 µs predicted for an answer's 263 x 32 words from L2, session 34's second review.)
template <int R, bool L2>
__device__ u64 car_best(const u64* src, int n, int k) {
    const int lane = threadIdx.x & 31;
    u64 mine = 0ull;
    for (int c0 = 0; c0 < n; c0 += 32 * R) {  // warp-uniform
        u64 x[R + 1];
#pragma unroll
        for (int j = 0; j < R; j++) {
            const int i = c0 + lane + 32 * j;
            x[j] = i < n ? (L2 ? __ldcg(src + i) : src[i]) : 0ull;
        }
        x[R] = mine;  // (the best k so far, one per lane: distinct from this chunk's words)
        u64 prev = ~0ull;
        mine = 0ull;
        for (int r = 0; r < k; r++) {
            u64 best = 0ull;
#pragma unroll
            for (int j = 0; j <= R; j++) best = (x[j] < prev && x[j] > best) ? x[j] : best;
            best = warp_max64(best);
            if (lane == r) mine = best;
            if (best == 0ull) break;  // (warp-uniform) no more entries
            prev = best;
        }
    }
    return mine;
}

// The best k of position q's G lists (res, [G][k] for q, read through L2), by all threads of
// the block: each warp the best k of its share, then warp 0 the best k of those (lane r: the
// r-th best; other warps: 0).
__device__ u64 car_merge(int q, int k, int G, const u64* res, u64 (*wbest)[32]) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wpb = blockDim.x >> 5;
    const int n = G * k;
    const int per = (n + wpb - 1) / wpb;
    const int lo = min(n, warp * per), hi = min(n, lo + per);
    wbest[warp][lane] = car_best<16, true>(res + (size_t)q * G * CAR_KMAX + lo, hi - lo, k);
    __syncthreads();
    const u64 best = warp == 0 ? car_best<KALOS_BLOCK / 32, false>(&wbest[0][0], 32 * wpb, k) : 0ull;  // (warp-uniform)
    __syncthreads();  // wbest free for the next merge
    return best;
}

// Warp 0 writes position q's answer (lane r: the r-th best, car_merge's) into its request's
// slot: rows, scores, its words and, last, the state CAR_DONE by a release store at system
// scope (st.release.sys, whatever `mode`: the host sees the results before the state; a weak
// store after a fence would order them by the hardware's habit, not by the memory model).
__device__ void car_write(int q, int k, u64 best, const int* pinfo, u64 slot0, int slot_bytes, int rows_off,
                          int scores_off, int mode) {
    const int lane = threadIdx.x & 31;
    const int* pi = pinfo + CAR_PINFO * q;
    const int slot = __ldcg(pi + 1);
    const unsigned int seq = (unsigned int)__ldcg(pi + 4);
    const u64 t0 = (u64)(unsigned int)__ldcg(pi + 5) | ((u64)(unsigned int)__ldcg(pi + 6) << 32);
    unsigned char* sb = reinterpret_cast<unsigned char*>(slot0 + (u64)slot * slot_bytes);
    unsigned int* w = reinterpret_cast<unsigned int*>(sb);
    const unsigned int nres = __popc(__ballot_sync(0xffffffffu, lane < k && best != 0ull));
    if (lane < k) {
        hstore(reinterpret_cast<int*>(sb + rows_off) + lane, best ? sel_pack_val(best) : -1, mode);
        hstore(reinterpret_cast<unsigned int*>(sb + scores_off) + lane,
               __float_as_uint(best ? sel_pack_key(best) : neg_inf()), mode);
    }
    if (lane == 0) {
        hstore(w + 4, nres, mode);
        hstore(w + 5, seq, mode);
        hstore(w + 6, (unsigned int)(global_ns() - t0), mode);
    }
    __syncwarp();
    if (lane == 0) asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(w), "r"(CAR_DONE) : "memory");  // last
}

// The answer to position q by the block that finished its turn last (KALOS_CAR_CLERK=0; all
// threads of the block call it): merged, written, then done_q = G + 1 tells the conductor the
// position is free (every read of its data is done).
__device__ void car_answer(int q, int k, int G, const u64* res, const int* pinfo, unsigned int* done_q,
                           u64 slot0, int slot_bytes, int rows_off, int scores_off, int mode, u64 (*wbest)[32]) {
    const u64 best = car_merge(q, k, G, res, wbest);
    if (threadIdx.x < 32) {
        car_write(q, k, best, pinfo, slot0, slot_bytes, rows_off, scores_off, mode);
        if (threadIdx.x == 0) {
            __threadfence();
            atomicExch(done_q, (unsigned int)G + 1u);
        }
    }
}

template <int NT, int METRIC>
__global__ void __launch_bounds__(KALOS_BLOCK, KALOS_CAR_MINB)
carousel_topk(const __half* __restrict__ data, int ld, int lds, int nrows, const int* __restrict__ ns,
              const float* __restrict__ sqnorm, int dim, u64 slot0, int slot_bytes, int n_slots,
              int rows_off, int scores_off, int mode, unsigned int* hctl, unsigned int* dctl, int* pinfo,
              __half* pos_q, u64* lists, u64* res) {
    constexpr int P = 8 * NT;
    constexpr int MT = 2, H = 2 * MT;  // two m16 tiles per warp tile: 32 rows (mma_filter's choice above 16 queries)
    static_assert(P <= 32, "one position per lane of a warp");
    extern __shared__ uint4 car_smem[];
    __shared__ float s_thr[P], s_qn2[P];
    __shared__ int s_cnt[P], s_rem[P], s_k[P], s_ns[P];
    __shared__ unsigned int s_gen[P];
    __shared__ unsigned int s_join, s_act, s_stop, s_fin, s_last;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wpb = blockDim.x >> 5;
    volatile unsigned int* done = dctl + 1 + P;

    __shared__ u64 s_wbest[KALOS_BLOCK / 32][32];  // a merge's best k of each warp's share
#ifdef KALOS_CAR_PROFILE
    __shared__ unsigned long long s_prof[CAR_PROF_W];
    if (threadIdx.x < CAR_PROF_W) s_prof[threadIdx.x] = 0ull;
    __syncthreads();
#endif

    if (blockIdx.x == 0) {
        // ---------------------------------------------------------------- the conductor
        __shared__ int s_slot[P], s_nreq;
        __shared__ unsigned int s_busy, s_due;
        const int G = gridDim.x - 1;
        u64 answered = 0;
        unsigned int rot = 0u, started = 0u;  // (warp 0's lane 0) where the slots' order starts; blocks seen started
        // the poll's loads of the slots' states: strong (ld.relaxed.sys) with KALOS_CAR_ACQUIRE,
        // whose fence makes one that saw REQUEST an acquire (a weak ld.cv cannot be one)
        const int poll_mode = KALOS_CAR_ACQUIRE ? ((mode & ~BELL_LDCV) | BELL_SYS) : mode;
        if (threadIdx.x == 0) {
            s_busy = 0u;
            CAR_PROF(CP_SMID, sm_id());
        }
        __syncthreads();
        for (;;) {
            CAR_STAMP(c0);
            // the stop word, answered positions, new requests: one round trip of PCIe for warp 0
            if (warp == 0) {
                const unsigned int stop = lane == 0 ? hload(hctl, mode) : 0u;
                if (lane == 0) {
                    const unsigned int st = *reinterpret_cast<volatile unsigned int*>(dctl + 1 + 2 * P);
                    if (st != started) { started = st; hstore(hctl + 4, st, mode); }
                }
                const unsigned int busy = s_busy;
                // a position the last of its blocks has answered (done = G + 1, KALOS_CAR_CLERK=0) is free again
                const unsigned int dq = lane < P && ((busy >> lane) & 1u) ? done[lane] : 0u;
                const bool ans = dq == (unsigned int)G + 1u;
                const unsigned int freed = __ballot_sync(0xffffffffu, ans);
                // (the clerk) positions every block has finished: this block merges them below
                const unsigned int due = __ballot_sync(0xffffffffu, KALOS_CAR_CLERK && dq == (unsigned int)G);
                if (ans) done[lane] = 0u;
                __threadfence();  // (done reset before the position's next gen)
                // requests: up to 64 slots, two per lane, both loads in flight
                unsigned int st0 = 0u, st1 = 0u;
                if (lane < n_slots) st0 = hload(reinterpret_cast<const unsigned int*>(slot0 + (u64)lane * slot_bytes), poll_mode);
                if (lane + 32 < n_slots) st1 = hload(reinterpret_cast<const unsigned int*>(slot0 + (u64)(lane + 32) * slot_bytes), poll_mode);
                const unsigned int r0 = __ballot_sync(0xffffffffu, st0 == CAR_REQUEST);
                const unsigned int r1 = __ballot_sync(0xffffffffu, st1 == CAR_REQUEST);
#if KALOS_CAR_ACQUIRE
                // (warp-uniform) the requests' queries and words after their states, in a round
                // that boards: a request seen with every position busy is polled again later
                const unsigned int room = ~(busy & ~freed) & (P == 32 ? 0xffffffffu : ((1u << P) - 1u));
                if ((r0 | r1) && room) asm volatile("fence.acq_rel.sys;" ::: "memory");
#endif
                const unsigned int any_stop = __ballot_sync(0xffffffffu, stop != 0u);
                if (lane == 0) {
                    s_stop = any_stop ? 1u : 0u;
                    s_due = due;
                    if (freed) {
                        answered += __popc(freed);
                        hstore(reinterpret_cast<u64*>(hctl + 2), answered, mode);
                    }
                    // free positions. The slots are taken in order from `rot`, which moves on
                    // each round: from slot 0 every time, slots 32-63 would wait while 0-31
                    // kept the positions full.
                    const unsigned int now_busy = busy & ~freed;
                    unsigned int free_ = ~now_busy & (P == 32 ? 0xffffffffu : ((1u << P) - 1u));
                    u64 req = ((u64)r1 << 32) | r0;
                    req = rot ? (req >> rot) | (req << (64 - rot)) : req;  // bit i: slot (i + rot) % 64
                    int n = 0;
                    while (req && free_) {
                        const int s = (__ffsll((long long)req) - 1 + rot) & 63;
                        const int p = __ffs(free_) - 1;
                        req &= req - 1;
                        free_ &= free_ - 1;
                        s_slot[n++] = s | (p << 8);
                    }
                    s_nreq = n;
                    s_busy = now_busy;
                    rot = (rot + 7) & 63;
                }
            }
            __syncthreads();
            CAR_STAMP(c1);
            CAR_PROF(CC_POLL, c1 - c0);
            if (s_stop) {
                if (threadIdx.x == 0) { atomicExch(dctl, 1u); __threadfence(); }
                CAR_FLUSH();
                return;
            }
#if KALOS_CAR_CLERK
            if (const unsigned int due = s_due) {  // (block-uniform)
                __threadfence();  // done seen complete before the blocks' lists are read
                for (unsigned int m = due; m; m &= m - 1) {
                    const int q = __ffs(m) - 1;
                    const int k = __ldcg(pinfo + CAR_PINFO * q);
                    CAR_STAMP(m0);
                    const u64 best = car_merge(q, k, G, res, s_wbest);
                    CAR_STAMP(m1);
                    CAR_PROF(CC_SELECT, m1 - m0);
                    if (warp == 0) car_write(q, k, best, pinfo, slot0, slot_bytes, rows_off, scores_off, mode);
                }
                // free the positions now (the blocks touch done[q] again only after its next gen,
                // which the boarding's fence orders after this)
                if (warp == 0) {
                    if (lane < P && ((due >> lane) & 1u)) done[lane] = 0u;
                    if (lane == 0) {
                        s_busy &= ~due;
                        answered += __popc(due);
                        hstore(reinterpret_cast<u64*>(hctl + 2), answered, mode);
                    }
                }
                __syncthreads();
                CAR_PROF(CC_NMERGE, __popc(due));
            }
#endif
            CAR_STAMP(c2);
            CAR_PROF(CC_MERGE, c2 - c1);
            // board the new requests: warp w takes requests w, w + wpb, ...
            const int nreq = s_nreq;
            for (int r = warp; r < nreq; r += wpb) {
                const int s = s_slot[r] & 255, p = s_slot[r] >> 8;
                unsigned int* w = reinterpret_cast<unsigned int*>(slot0 + (u64)s * slot_bytes);
                const float* q = reinterpret_cast<const float*>(slot0 + (u64)s * slot_bytes + CAR_HEAD_BYTES);
                const unsigned int k = hload(w + 1, mode);
                const int qns = hload(reinterpret_cast<const int*>(w + 2), mode);
                const unsigned int seq = hload(w + 3, mode);
                // the query: 4 floats a load, every load of the lane in flight before its use,
                // staged in this warp's part of the dynamic shared memory (the conductor holds
                // no queries there: 4 x dim bytes a warp, at most half of the 2 x 32 x lds bytes
                // the host gives), then normalized for cosine and stored as halves
                float* stage = reinterpret_cast<float*>(car_smem) + (size_t)warp * dim;
                float part = 0.f, amax = 0.f;
                for (int i = 4 * lane; i < dim; i += 128) {
                    float v[4];
                    if (i + 3 < dim) {
                        const uint4 u = hload4(q + i, mode);
                        v[0] = __uint_as_float(u.x); v[1] = __uint_as_float(u.y);
                        v[2] = __uint_as_float(u.z); v[3] = __uint_as_float(u.w);
                    } else {
#pragma unroll
                        for (int j = 0; j < 4; j++) v[j] = i + j < dim ? hload(q + i + j, mode) : 0.f;
                    }
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        part += v[j] * v[j];
                        amax = fmaxf(amax, fabsf(v[j]));
                        if (i + j < dim) stage[i + j] = v[j];
                    }
                }
                for (int o = 16; o > 0; o >>= 1) {
                    part += __shfl_xor_sync(0xffffffffu, part, o);
                    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
                }
                __syncwarp();
                const bool ok = k >= 1u && k <= (unsigned int)CAR_KMAX && isfinite(part) &&
                                (METRIC == METRIC_COSINE || amax <= 65504.f) && (ns != nullptr || qns == NS_ANY);
                const float sc = METRIC == METRIC_COSINE && part > 0.f ? rsqrtf(part) : 1.f;
                for (int i = lane; i < ld; i += 32) pos_q[(size_t)p * ld + i] = __float2half(i < dim ? stage[i] * sc : 0.f);
                if (!ok) {  // refused at once (the reasons: above the kernel)
                    __syncwarp();
                    if (lane == 0) {
                        hstore(w + 4, 0u, mode);
                        hstore(w + 5, seq, mode);
                        __threadfence_system();
                        hstore(w, CAR_ERROR, mode);
                    }
                    continue;
                }
                if (lane == 0) {
                    const u64 t0 = global_ns();
                    int* pi = pinfo + CAR_PINFO * p;
                    pi[0] = (int)k;
                    pi[1] = s;
                    pi[2] = qns;
                    pi[3] = __float_as_int(METRIC == METRIC_COSINE && part > 0.f ? 1.f : part);
                    pi[4] = (int)seq;
                    pi[5] = (int)(unsigned int)t0;
                    pi[6] = (int)(unsigned int)(t0 >> 32);
                    hstore(w, CAR_TAKEN, mode);
                    __threadfence_system();  // TAKEN in host memory before any block can answer (DONE)
                }
                __threadfence();  // the query and its words before gen
                __syncwarp();
                if (lane == 0) {
                    __threadfence();  // (on the thread that moves gen: the warp's writes, released)
                    atomicAdd(dctl + 1 + p, 1u);
                    atomicOr(&s_busy, 1u << p);
                }
            }
            __syncthreads();
            CAR_STAMP(c3);
            CAR_PROF(CC_BOARD, c3 - c2);
            CAR_PROF(CC_NBOARD, nreq);
            CAR_PROF(CC_ROUNDS, 1);
            CAR_FLUSH();
        }
    }

    // -------------------------------------------------------------------- the scanning blocks
    __half* qs = reinterpret_cast<__half*>(car_smem);
    const int b = blockIdx.x - 1, G = gridDim.x - 1;
    if (threadIdx.x == 0) atomicAdd(dctl + 1 + 2 * P, 1u);  // started (see hctl[4])
    const int rows_per_tile = 16 * MT;
    const int tiles_total = (nrows + rows_per_tile - 1) / rows_per_tile;
    const int t_lo = (int)((long long)tiles_total * b / G), t_hi = (int)((long long)tiles_total * (b + 1) / G);
    const int steps = max(1, (t_hi - t_lo + wpb - 1) / wpb);
    u64* mylists = lists + (size_t)b * P * CAR_CAP;
    if (threadIdx.x < P) { s_gen[threadIdx.x] = 0u; s_rem[threadIdx.x] = 0; s_cnt[threadIdx.x] = 0; }
    CAR_PROF(CP_SMID, sm_id());
    CAR_PROF(CP_TILES, t_hi - t_lo);
    int step = 0;
    const int cpr = ld / 8;
    const uint4* rows16 = reinterpret_cast<const uint4*>(data);
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    for (;;) {
        // (every thread has read the last step's words before warp 0 writes them again)
        __syncthreads();
        CAR_STAMP(t0);
        // the step's start: stop? positions to board?
        if (warp == 0) {
            bool join = false;
            const unsigned int stop = lane == 0 ? *reinterpret_cast<volatile unsigned int*>(dctl) : 0u;
            if (lane < P && s_rem[lane] == 0) {
                const unsigned int g = ld_acquire(dctl + 1 + lane);  // gen before the query and its words
                if (g != s_gen[lane]) {
                    s_gen[lane] = g;
                    s_rem[lane] = steps;
                    s_cnt[lane] = 0;
                    s_thr[lane] = neg_inf();
                    s_k[lane] = __ldcg(pinfo + CAR_PINFO * lane);
                    s_ns[lane] = __ldcg(pinfo + CAR_PINFO * lane + 2);
                    s_qn2[lane] = __int_as_float(__ldcg(pinfo + CAR_PINFO * lane + 3));
                    join = true;
                }
            }
            const unsigned int jm = __ballot_sync(0xffffffffu, join);
            const unsigned int am = __ballot_sync(0xffffffffu, lane < P && s_rem[lane] > 0);
            if (lane == 0) {
                s_join = jm;
                s_act = am;
                s_stop = stop;
                s_last = 0u;
            }
        }
        __syncthreads();
        if (s_stop) {
            CAR_FLUSH();
            return;
        }
        const unsigned int act = s_act;
        if (s_join) {  // the boarding positions' queries into shared memory, through L2
            const unsigned int jm = s_join;
            for (int i = threadIdx.x; i < P * cpr; i += blockDim.x) {
                const int q = i / cpr, c = i - q * cpr;
                if ((jm >> q) & 1u)
                    *reinterpret_cast<uint4*>(qs + (size_t)q * lds + 8 * c) =
                        __ldcg(reinterpret_cast<const uint4*>(pos_q + (size_t)q * ld) + c);
            }
            __syncthreads();
        }
        if (act == 0u) {  // nothing aboard: wait for a boarding (the turn starts wherever it comes)
            __nanosleep(500);
            CAR_STAMP(ti);
            CAR_PROF(CP_IDLE, ti - t0);
            CAR_PROF(CP_NIDLE, 1);
            continue;
        }
        CAR_STAMP(t1);
        CAR_PROF(CP_START, t1 - t0);
        // this step's tile for each warp: score it against every aboard position
        const int tile = t_lo + step * wpb + warp;
        if (tile < t_hi) {
            const int t = lane & 3, g = lane >> 2;
            const int r0 = tile * rows_per_tile;
            bool rok[H];
#pragma unroll
            for (int h = 0; h < H; h++) rok[h] = r0 + g + 8 * h < nrows;
            const uint4* rp = rows16 + (size_t)(r0 + g) * cpr;
            float acc[MT][NT][4];
#pragma unroll
            for (int m = 0; m < MT; m++)
#pragma unroll
                for (int j = 0; j < NT; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) acc[m][j][e] = 0.f;
            constexpr int S = KALOS_MMA_STEPS;
            for (int k0 = 0; k0 < ld; k0 += 32 * S) {
                uint4 a[S][H];
#pragma unroll
                for (int u = 0; u < S; u++) {
                    const int kc = k0 + 32 * u + 8 * t;
#pragma unroll
                    for (int h = 0; h < H; h++) a[u][h] = (kc < ld && rok[h]) ? __ldg(rp + (size_t)8 * h * cpr + kc / 8) : zero;
                }
#pragma unroll
                for (int u = 0; u < S; u++) {
                    if (k0 + 32 * u >= ld) break;
                    const int kc = k0 + 32 * u + 8 * t;
#pragma unroll
                    for (int j = 0; j < NT; j++) {
                        if (((act >> (8 * j)) & 0xffu) == 0u) continue;  // (warp-uniform) no position of this n-tile aboard
                        const uint4 bq = kc < ld ? *reinterpret_cast<const uint4*>(qs + (size_t)(8 * j + g) * lds + kc) : zero;
#pragma unroll
                        for (int m = 0; m < MT; m++)
                            mma16816(acc[m][j], a[u][2 * m].x, a[u][2 * m + 1].x, a[u][2 * m].y, a[u][2 * m + 1].y, bq.x, bq.y);
#pragma unroll
                        for (int m = 0; m < MT; m++)
                            mma16816(acc[m][j], a[u][2 * m].z, a[u][2 * m + 1].z, a[u][2 * m].w, a[u][2 * m + 1].w, bq.z, bq.w);
                    }
                }
            }
#pragma unroll
            for (int h = 0; h < H; h++) {
                const int row = r0 + g + 8 * h;
                if (!rok[h]) continue;
                const int rns = ns != nullptr ? ns[row] : NS_ANY;
                const float sqn = METRIC == METRIC_L2 ? sqnorm[row] : 0.f;
#pragma unroll
                for (int j = 0; j < NT; j++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int q = 8 * j + 2 * t + e;
                        if (!((act >> q) & 1u)) continue;
                        if (s_ns[q] != NS_ANY && rns != s_ns[q]) continue;
                        float sc = acc[h >> 1][j][2 * (h & 1) + e];
                        if (METRIC == METRIC_L2) sc = -sqrtf(fmaxf(s_qn2[q] + sqn - 2.f * sc, 0.f));
                        if (sc >= s_thr[q]) {
                            const int at = atomicAdd(&s_cnt[q], 1);
                            mylists[(size_t)q * CAR_CAP + at] = sel_pack(sc, row);
                        }
                    }
            }
        }
        __syncthreads();
        CAR_STAMP(t2);
        CAR_PROF(CP_SCAN, t2 - t1);
        // the step's end: each aboard position one step nearer the end of its turn; a list that
        // might not hold another step cut to its best k; a finished turn's best k to res
        if (warp == 0) {  // (lane q: position q)
            const bool on = lane < P && ((act >> lane) & 1u);
            const int rem = on ? --s_rem[lane] : 1;
            const bool f = on && (rem == 0 || s_cnt[lane] > CAR_CAP - CAR_STEP_ROWS);
            const unsigned int fm = __ballot_sync(0xffffffffu, f);
#ifdef KALOS_CAR_PROFILE
            const unsigned int ends = __ballot_sync(0xffffffffu, f && rem == 0);
            int listn = f ? s_cnt[lane] : 0;
            for (int o = 16; o > 0; o >>= 1) listn += __shfl_xor_sync(0xffffffffu, listn, o);
            CAR_PROF(CP_NFINAL, __popc(ends));
            CAR_PROF(CP_NCUT, __popc(fm & ~ends));
            CAR_PROF(CP_LISTN, listn);
#endif
            if (lane == 0) s_fin = fm;
        }
        __syncthreads();
        CAR_STAMP(t3);
        CAR_PROF(CP_END, t3 - t2);
        CAR_PROF(CP_STEPS, 1);
        CAR_PROF(CP_ABOARD, __popc(act));
        const unsigned int fin = s_fin;
        if (fin) {
            for (int q = warp; q < P; q += wpb) {
                if (!((fin >> q) & 1u)) continue;
                const int k = s_k[q], n = s_cnt[q];
                const u64* list = mylists + (size_t)q * CAR_CAP;
                const u64 best = KALOS_CAR_SHORT && n <= 64 ? car_best<2, false>(list, n, k)  // (warp-uniform)
                                                            : car_best<CAR_CAP / 32, false>(list, n, k);  // (one chunk)
                __syncwarp();
                if (s_rem[q] == 0) {  // the turn is over: its best k for the merge ([P][G][k], dense)
                    if (lane < k) res[(size_t)q * G * CAR_KMAX + (size_t)b * k + lane] = best;
                    if (!KALOS_CAR_CLERK) __threadfence();  // (the clerk's: released by the add below)
                } else {
                    if (lane < k) mylists[(size_t)q * CAR_CAP + lane] = best;
                    const u64 kth = __shfl_sync(0xffffffffu, best, k - 1);
                    if (lane == 0) {
                        s_cnt[q] = min(n, k);
                        if (kth != 0ull) s_thr[q] = sel_pack_key(kth);
                    }
                }
            }
            __syncthreads();
            CAR_STAMP(t4);
            CAR_PROF(CP_CUT, t4 - t3);
            // a finished turn counted in done[p] (with KALOS_CAR_CLERK=0 the block whose add makes
            // G merges every block's best k and answers: a fence on the adding thread on each
            // side of its add, the release of the lists the block's other warps wrote and fenced
            // before the barrier, and the last one's acquire)
            if (threadIdx.x < P && ((fin >> threadIdx.x) & 1u) && s_rem[threadIdx.x] == 0) {
#if KALOS_CAR_CLERK
                // a release: the block's writes of res (its other warps', before the barrier
                // above) are seen by whoever acquires this count (the conductor, at G)
                red_release_add(dctl + 1 + P + threadIdx.x, 1u);
#else
                __threadfence();
                if (atomicAdd(dctl + 1 + P + threadIdx.x, 1u) == (unsigned int)G - 1u) atomicOr(&s_last, 1u << threadIdx.x);
                __threadfence();
#endif
            }
            __syncthreads();
            CAR_STAMP(t5);
            CAR_PROF(CP_DONE, t5 - t4);
            const unsigned int last = s_last;  // (0 with the clerk: the conductor answers)
            if (last) {
                __threadfence();  // done seen complete before the other blocks' lists are read
                for (unsigned int m = last; m; m &= m - 1) {
                    const int q = __ffs(m) - 1;
                    car_answer(q, s_k[q], G, res, pinfo, dctl + 1 + P + q, slot0, slot_bytes, rows_off, scores_off,
                               mode, s_wbest);
                }
                CAR_STAMP(t6);
                CAR_PROF(CP_MERGE, t6 - t5);
                CAR_PROF(CP_NMERGE, __popc(last));
            }
        }
        CAR_FLUSH();
        step = step + 1 == steps ? 0 : step + 1;
    }
}

// ------------------------------------------------------------------------------------------
// Row maintenance: writes of upserts, compaction moves, reads for MMR.

// dst[rows[i]] = convert(src[i]) for n rows; src float32 [n][dim], dst T [.][ld] (pad zeroed).
// For int8 storage, rowscale[rows[i]] receives max|x|/127 and the row is quantized with it.
template <typename T>
__global__ void set_rows(const float* __restrict__ src, const long long* __restrict__ rows, int n,
                         int dim, int ld, T* __restrict__ dst, float* __restrict__ sqnorm,
                         float* __restrict__ rowscale) {
    int i = blockIdx.x;
    if (i >= n) return;
    const float* x = src + (size_t)i * dim;
    T* y = dst + (size_t)rows[i] * ld;
    __shared__ float red[KALOS_BLOCK / 32];
    __shared__ float amax_s;
    float s = 0.f, amax = 0.f;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) { s += x[j] * x[j]; amax = fmaxf(amax, fabsf(x[j])); }
    for (int o = 16; o > 0; o >>= 1) {
        s += __shfl_xor_sync(0xffffffff, s, o);
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, o));
    }
    __shared__ float redm[KALOS_BLOCK / 32];
    if ((threadIdx.x & 31) == 0) { red[threadIdx.x >> 5] = s; redm[threadIdx.x >> 5] = amax; }
    __syncthreads();
    if (threadIdx.x == 0) {
        float t = 0.f, m = 0.f;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) { t += red[w]; m = fmaxf(m, redm[w]); }
        sqnorm[rows[i]] = t;
        amax_s = m;
    }
    __syncthreads();
    float inv = 1.f;
    if (rowscale != nullptr) {
        float sc = amax_s > 0.f ? amax_s / 127.f : 1.f;
        if (threadIdx.x == 0) rowscale[rows[i]] = sc;
        inv = 1.f / sc;
    }
    for (int j = threadIdx.x; j < ld; j += blockDim.x) {
        float v = j < dim ? x[j] : 0.f;
        if (rowscale != nullptr) {
            float r = rintf(v * inv);
            r = fminf(fmaxf(r, -127.f), 127.f);
            y[j] = (T)(int)r;
        } else {
            y[j] = (T)v;
        }
    }
}

// rows dst[i] <- rows src[i] (whole rows, plus ns/sqnorm/scale); src rows become tombstones.
template <typename T>
__global__ void move_rows(T* __restrict__ data, int* __restrict__ ns, float* __restrict__ sqnorm,
                          float* __restrict__ rowscale, const long long* __restrict__ src,
                          const long long* __restrict__ dst, int n, int ld) {
    int i = blockIdx.x;
    if (i >= n) return;
    const T* a = data + (size_t)src[i] * ld;
    T* b = data + (size_t)dst[i] * ld;
    for (int j = threadIdx.x; j < ld; j += blockDim.x) b[j] = a[j];
    if (threadIdx.x == 0) {
        ns[dst[i]] = ns[src[i]];
        sqnorm[dst[i]] = sqnorm[src[i]];
        if (rowscale != nullptr) rowscale[dst[i]] = rowscale[src[i]];
        ns[src[i]] = -1;
    }
}

// out[i][:dim] = float(data[rows[i]][:dim]) (times the row scale for int8).
template <typename T>
__global__ void get_rows(const T* __restrict__ data, const float* __restrict__ rowscale,
                         const long long* __restrict__ rows, int n, int dim, int ld,
                         float* __restrict__ out) {
    int i = blockIdx.x;
    if (i >= n) return;
    const T* a = data + (size_t)rows[i] * ld;
    float sc = rowscale != nullptr ? rowscale[rows[i]] : 1.f;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) out[(size_t)i * dim + j] = (float)a[j] * sc;
}

// Measurement aid (benchmarks/persistent_probe.py), the floor of a persistent kernel's
// signalling: one thread spins on a doorbell word in host-mapped memory and answers on another.
__global__ void doorbell_probe(volatile int* bell, volatile int* done, int rounds) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    for (int i = 1; i <= rounds; i++) {
        while (*bell < i) { }
        *done = i;
        __threadfence_system();
    }
}

// doorbell_probe_blocks: the same ping-pong from block 0, thread 0, while the other blocks do
// what doorbell_topk's waiting blocks do, to find what made the resident kernel see requests
// late (benchmarks/persistent_probe.py --variants). mode 0: the others return at once; 1: they
// spin on a device word; 2: they spin with __nanosleep(100). Each round block 0 also reads
// `nwords` host words (a request's control words). flags: the BELL_* bits (how host memory is
// loaded and stored; BELL_FENCE: a system fence after the answer), PROBE_SAME_WORD (the answer
// goes into the polled word itself, as -i after a 0, as doorbell_topk's state word does). It
// returns when the host sets *stop (or after `rounds`), releasing the others
// through dev[0].
#define PROBE_SAME_WORD 16
__global__ void doorbell_probe_blocks(int* bell, int* done, int* stop, const unsigned int* words, int nwords,
                                      int rounds, int mode, int flags, unsigned int* dev) {
    if (blockIdx.x != 0) {
        if (mode == 0 || threadIdx.x != 0) return;
        while (*reinterpret_cast<volatile unsigned int*>(dev) == 0) {
            if (mode == 2) __nanosleep(100);
        }
        return;
    }
    if (threadIdx.x != 0) return;
    unsigned int sink = 0;
    for (int i = 1; i <= rounds; i++) {
        bool stopped = false;
        while (hload(bell, flags) != i) {
            if (hload(stop, flags)) { stopped = true; break; }
        }
        if (stopped) break;
        for (int w = 0; w < nwords; w++) sink += hload(words + w, flags);
        if (flags & PROBE_SAME_WORD) {
            hstore(bell, 0, flags);
            hstore(bell, -i, flags);
        } else {
            hstore(done, i, flags);
        }
        if (flags & BELL_FENCE) __threadfence_system();
    }
    dev[1] = sink;
    *reinterpret_cast<volatile unsigned int*>(dev) = 1;
}

// Fault injection for the reliability tests: an illegal address, which leaves the context in a
// sticky error state. Launched only when the sidecar runs with KALOS_FAULT_INJECT=illegal_address.
__global__ void fault_kernel(int* p) { p[threadIdx.x] = 1; }

// ------------------------------------------------------------------------------------------
// Explicit instantiations so that `nvcc -c` (CI) compiles every kernel the sidecar uses.
// The sidecar asks NVRTC for the same names through name_expressions.
#ifdef KALOS_INSTANTIATE
#define SCAN(T, TPR, QB, M) template __global__ void scan_topk<T, TPR, QB, M>(const T*, const int*, const float*, const float*, const Params*, const float*, const signed char*, int, int, float*, int*, unsigned int*);
SCAN(__half, 4, 1, 0) SCAN(__half, 8, 1, 0) SCAN(float, 8, 1, 0) SCAN(signed char, 4, 1, 0) SCAN(__half, 1, 8, 2)
#define SCANL(T, TPR, QB, M) template __global__ void scan_list<T, TPR, QB, M>(const T*, const int*, const float*, const float*, const Params*, const float*, const signed char*, int, int, float*, int*, unsigned int*);
SCANL(__half, 4, 1, 0) SCANL(__half, 4, 8, 1) SCANL(signed char, 4, 1, 2) SCANL(float, 8, 2, 0)
#define BELL(T, TPR, M, L) template __global__ void doorbell_topk<T, TPR, M, L>(const T*, const int*, const float*, const float*, Params*, float*, signed char*, int, int, float*, int*, unsigned int*, BellCtl*, const BellCtl*, unsigned int*, int*);
BELL(__half, 4, 0, false) BELL(signed char, 2, 0, false) BELL(signed char, 2, 2, false) BELL(float, 8, 1, false)
BELL(__half, 4, 0, true) BELL(signed char, 2, 0, true) BELL(signed char, 2, 2, true) BELL(float, 8, 1, true)
template __global__ void prep_queries<0>(const Desc*, Params*, float*, __half*, signed char*, int, int, const float*, int*, float*);
template __global__ void topk_scores<0>(const float*, int, const int*, const float*, const float*, const Params*, int, float*, int*, unsigned int*);
template __global__ void tau_scores<0>(const float*, int, const int*, const float*, const Params*, int, float*, int);
template __global__ void filter_scores<0>(const float*, int, const int*, const float*, const Params*, const float*, float*, int*, int*, int);
template __global__ void select_cands<0>(const float*, const int*, int*, int, const Params*, int*);
#define MMA(NT, M) template __global__ void mma_filter<NT, M>(const __half*, int, int, int, const int*, const float*, const Params*, const __half*, const float*, float*, int*, int*, int, float*, int);
#define MMA_DUMP(NT, M) template __global__ void mma_filter<NT, M, true>(const __half*, int, int, int, const int*, const float*, const Params*, const __half*, const float*, float*, int*, int*, int, float*, int);
MMA(2, 0) MMA(4, 1) MMA(8, 2) MMA_DUMP(2, 0) MMA_DUMP(4, 1) MMA_DUMP(8, 2)
#define CAROUSEL(NT, M) template __global__ void carousel_topk<NT, M>(const __half*, int, int, int, const int*, const float*, int, u64, int, int, int, int, int, unsigned int*, unsigned int*, int*, __half*, u64*, u64*);
CAROUSEL(4, 0) CAROUSEL(4, 1) CAROUSEL(4, 2)
template __global__ void set_rows<__half>(const float*, const long long*, int, int, int, __half*, float*, float*);
template __global__ void set_rows<signed char>(const float*, const long long*, int, int, int, signed char*, float*, float*);
template __global__ void move_rows<float>(float*, int*, float*, float*, const long long*, const long long*, int, int);
template __global__ void get_rows<__half>(const __half*, const float*, const long long*, int, int, int, float*);
#endif
