// Row gather and scatter between a table (pinned host memory or GPU memory) and GPU memory.
//
// The Python side is `datapath.memory.rows`; every row fetch of datapath (unified tensors, the
// loaders, the feature store's tiers) launches one of these kernels.
//
// A table in pinned, GPU-mapped host memory is read over PCIe.  PCIe requests are most
// efficient when each warp-wide access covers whole, aligned 128-byte lines.  A row that
// starts at a misaligned address would make every warp access straddle two lines.  Three
// access schemes are compiled, selected by MODE:
//
//   0  unaligned:      lane j reads word (k*G + j) of the row from the row start;
//   1  shift-and-mask: lanes start at the 128-byte line below the row start and
//                      the lanes that fall before the row start or after its end
//                      idle (DGL's UVA gather);
//   2  circular shift: like 1, but the lanes that fall before the row start
//                      take the row's last words instead, so no lane idles and
//                      each row takes ceil(words / G) steps (PyTorch-Direct).
//
// A group of G lanes (G a power of two <= 32) handles one row at a time; for rows of
// fewer than 32 words a warp holds several groups.  Words are W bytes (W = 16, 8, 4, 2 or
// 1), the widest that divides the row size, the row stride and the base addresses.
// Every lane keeps UNROLL loads in flight before it stores them, so that enough bytes are
// in flight to cover PCIe latency: a long row is moved UNROLL words per lane at a time,
// and a short row (one or two steps of G words) is moved together with the next rows of
// the group (4 rows of one step, 2 rows of two steps).
//
// Two ways to find a row:
//
//   plain    `idx[pos]` indexes the table; a valid index lies in [-n_rows, n_rows)
//            (negatives wrap, as in PyTorch).  An invalid index never reaches memory: the
//            gather writes zeros into that output row, the scatter skips it, and the bad
//            value and the table's row count are stored in err[0], err[1] so that the host
//            can raise IndexError naming both.
//   tiered   `loc[pos]` names a row of one of two tables (the feature store's GPU cache
//            and its host tier): 1..n_a is row loc-1 of table a, n_a+1..n_a+n_b row
//            loc-1-n_a of table b; 0 marks an index the slot lookup found out of range
//            (zeros written), and a negative value a row another tier fills later
//            (skipped).  `counts` (optional) receives the rows taken from a, from b, and
//            skipped.
//
// Locality: when `order` is given, the keys (idx or loc) arrive sorted and order[k] is the
// position of sorted key k in the caller's array (its output row).  Consecutive warps
// then read nearby table rows, which share address translations: random rows from a
// table of many GB otherwise cost a translation miss each, and that, not PCIe, limits
// small rows.

#include <cstdint>

namespace {

template <int W> struct Word;
template <> struct Word<16> { using T = uint4; };
template <> struct Word<8> { using T = uint2; };
template <> struct Word<4> { using T = unsigned int; };
template <> struct Word<2> { using T = unsigned short; };
template <> struct Word<1> { using T = unsigned char; };

template <int W> __device__ __forceinline__ typename Word<W>::T zero_word();
template <> __device__ __forceinline__ uint4 zero_word<16>() { return make_uint4(0, 0, 0, 0); }
template <> __device__ __forceinline__ uint2 zero_word<8>() { return make_uint2(0, 0); }
template <> __device__ __forceinline__ unsigned int zero_word<4>() { return 0u; }
template <> __device__ __forceinline__ unsigned short zero_word<2>() { return 0; }
template <> __device__ __forceinline__ unsigned char zero_word<1>() { return 0; }

constexpr int UNROLL = 4;
constexpr int LINE = 128;

// How a lane loads a 16-byte word of a table row: DP_LOAD_HINT 0 (the default) a plain load;
// 1, 2: with the L2 prefetch-size hint .L2::128B / .L2::256B; 3: through the non-coherent
// path with .L2::256B.  (Variants for an ablation: compile with -DDP_LOAD_HINT=N.)
#ifndef DP_LOAD_HINT
#define DP_LOAD_HINT 0
#endif

template <int W>
__device__ __forceinline__ typename Word<W>::T load_table_word(const typename Word<W>::T* p) {
    if constexpr (W == 16 && DP_LOAD_HINT != 0) {
        uint4 v;
#if DP_LOAD_HINT == 1
        asm volatile("ld.global.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#elif DP_LOAD_HINT == 2
        asm volatile("ld.global.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#else
        asm volatile("ld.global.nc.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#endif
        return v;
    } else {
        return *p;
    }
}

// What `find` says about a row.
constexpr int ROW_COPY = 1;   // move it
constexpr int ROW_ZERO = 0;   // out of range: write zeros (gather) / skip (scatter)
constexpr int ROW_SKIP = -1;  // another tier fills it: leave the output row alone

// Rows of one table, found through an index array with PyTorch's bounds rules.
template <typename I>
struct PlainRows {
    char* table;
    long long n_rows;
    long long stride;
    const I* idx;
    long long* err;

    __device__ __forceinline__ char* find(long long key_pos, int& state, int& tier) const {
        long long i = static_cast<long long>(idx[key_pos]);
        long long r = i < 0 ? i + n_rows : i;
        tier = 0;
        if (r < 0 || r >= n_rows) {
            err[0] = i;  // any one bad value will do; plain stores, last writer wins
            err[1] = n_rows;
            state = ROW_ZERO;
            return nullptr;
        }
        state = ROW_COPY;
        return table + r * stride;
    }
};

// Rows of two tables named by a slot per position (see the file comment).
struct TierRows {
    char* a;
    long long a_stride;
    long long n_a;
    char* b;
    long long b_stride;
    long long n_b;
    const int* loc;
    long long* err;

    __device__ __forceinline__ char* find(long long key_pos, int& state, int& tier) const {
        long long v = static_cast<long long>(loc[key_pos]);
        if (v < 0) {
            state = ROW_SKIP;
            tier = 2;
            return nullptr;
        }
        if (v >= 1 && v <= n_a) {
            state = ROW_COPY;
            tier = 0;
            return a + (v - 1) * a_stride;
        }
        if (v > n_a && v <= n_a + n_b) {
            state = ROW_COPY;
            tier = 1;
            return b + (v - 1 - n_a) * b_stride;
        }
        if (v != 0) {  // a slot outside both tables: never read (the map is corrupt)
            err[0] = v;
            err[1] = n_a + n_b;
        }
        state = ROW_ZERO;
        tier = 3;
        return nullptr;
    }
};

// Map step position q of a row to its word number, or -1 for an idle lane.  `shift` is the
// number of words between the 128-byte line below the row start and the row start.
template <int MODE>
__device__ __forceinline__ long long word_of(long long q, long long n, long long shift) {
    if (MODE == 0) return q < n ? q : -1;
    if (MODE == 1) {
        long long p = q - shift;
        return (p >= 0 && p < n) ? p : -1;
    }
    // MODE 2: rotation by `shift` (mod n); positions q < shift take the row's tail.
    if (q >= n) return -1;
    long long p = q - (shift < n ? shift : shift % n);
    return p >= 0 ? p : p + n;
}

template <int W, int MODE>
__device__ __forceinline__ long long shift_of(const char* table_row) {
    return MODE == 0 ? 0 : static_cast<long long>((reinterpret_cast<uintptr_t>(table_row) % LINE) / W);
}

// One group of G lanes moves one long row, UNROLL words per lane at a time.  DIR 0: table ->
// device row (gather); DIR 1: device row -> table (scatter).
template <int W, int MODE, int DIR>
__device__ __forceinline__ void move_row(char* table_row, char* dev_row, long long n, int G, int lane) {
    using T = typename Word<W>::T;
    const long long shift = shift_of<W, MODE>(table_row);
    const long long span = MODE == 1 ? n + shift : n;
    T* h = reinterpret_cast<T*>(table_row);
    T* d = reinterpret_cast<T*>(dev_row);
    for (long long base = 0; base < span; base += static_cast<long long>(G) * UNROLL) {
        T v[UNROLL];
        long long w[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            w[u] = word_of<MODE>(base + static_cast<long long>(u) * G + lane, n, shift);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (w[u] >= 0) v[u] = DIR == 0 ? load_table_word<W>(h + w[u]) : d[w[u]];
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (w[u] >= 0) {
                if (DIR == 0) d[w[u]] = v[u]; else h[w[u]] = v[u];
            }
        }
    }
}

template <int W>
__device__ __forceinline__ void zero_row(char* dev_row, long long n, int G, int lane) {
    using T = typename Word<W>::T;
    T* d = reinterpret_cast<T*>(dev_row);
    for (long long q = lane; q < n; q += G) d[q] = zero_word<W>();
}

__device__ __forceinline__ void count_row(unsigned long long* block_counts, int tier, int lane) {
    if (block_counts != nullptr && lane == 0 && tier < 3) atomicAdd(&block_counts[tier], 1ull);
}

// One group moves R short rows of S steps each (R * S <= UNROLL): all their loads are
// issued before the first store.  p0 is the first key position.
template <int W, int MODE, int DIR, int R, int S, class Rows>
__device__ __forceinline__ void move_short_rows(const Rows& rows, long long p0, long long n_idx,
                                                const long long* __restrict__ order, char* __restrict__ dev,
                                                long long row_bytes, long long n, int G, int lane,
                                                unsigned long long* block_counts) {
    using T = typename Word<W>::T;
    char* trow[R];
    char* drow[R];
    long long shift[R];
    int state[R];
#pragma unroll
    for (int k = 0; k < R; ++k) {
        const long long pos = p0 + k;
        state[k] = ROW_SKIP;
        trow[k] = nullptr;
        drow[k] = nullptr;
        shift[k] = 0;
        if (pos < n_idx) {
            int tier;
            trow[k] = rows.find(pos, state[k], tier);
            count_row(block_counts, tier, lane);
            drow[k] = dev + (order ? order[pos] : pos) * row_bytes;
            if (state[k] == ROW_COPY) shift[k] = shift_of<W, MODE>(trow[k]);
        }
    }
    T v[R * S];
    long long w[R * S];
#pragma unroll
    for (int k = 0; k < R; ++k) {
#pragma unroll
        for (int s = 0; s < S; ++s) {
            w[k * S + s] = state[k] == ROW_COPY
                               ? word_of<MODE>(static_cast<long long>(s) * G + lane, n, shift[k]) : -1;
        }
    }
#pragma unroll
    for (int k = 0; k < R; ++k) {
#pragma unroll
        for (int s = 0; s < S; ++s) {
            const long long wk = w[k * S + s];
            if (wk >= 0) {
                v[k * S + s] = DIR == 0 ? load_table_word<W>(reinterpret_cast<const T*>(trow[k]) + wk)
                                        : reinterpret_cast<const T*>(drow[k])[wk];
            }
        }
    }
#pragma unroll
    for (int k = 0; k < R; ++k) {
#pragma unroll
        for (int s = 0; s < S; ++s) {
            const long long wk = w[k * S + s];
            if (wk >= 0) {
                if (DIR == 0) reinterpret_cast<T*>(drow[k])[wk] = v[k * S + s];
                else reinterpret_cast<T*>(trow[k])[wk] = v[k * S + s];
            }
        }
        if (DIR == 0 && state[k] == ROW_ZERO) zero_row<W>(drow[k], n, G, lane);
    }
}

template <int W, int MODE, int DIR, int R, int S, class Rows>
__device__ __forceinline__ void loop_short(const Rows& rows, long long n_idx, const long long* order, char* dev,
                                           long long row_bytes, long long n, int G, int lane, long long group,
                                           long long n_groups, unsigned long long* block_counts) {
    for (long long p0 = group * R; p0 < n_idx; p0 += n_groups * R) {
        move_short_rows<W, MODE, DIR, R, S>(rows, p0, n_idx, order, dev, row_bytes, n, G, lane, block_counts);
    }
}

template <int W, int MODE, int DIR, class Rows>
__device__ void rows_kernel(const Rows& rows, const long long* __restrict__ order, long long n_idx,
                            char* __restrict__ dev, long long row_bytes, int G,
                            unsigned long long* counts) {
    __shared__ unsigned long long block_counts_mem[3];
    unsigned long long* block_counts = nullptr;
    if (counts != nullptr) {  // uniform over the grid: every thread reaches the barriers
        if (threadIdx.x < 3) block_counts_mem[threadIdx.x] = 0;
        __syncthreads();
        block_counts = block_counts_mem;
    }
    const long long n = row_bytes / W;  // words per row
    const int lane = threadIdx.x % G;
    const long long groups_per_block = blockDim.x / G;
    const long long group = static_cast<long long>(blockIdx.x) * groups_per_block + threadIdx.x / G;
    const long long n_groups = static_cast<long long>(gridDim.x) * groups_per_block;
    // steps of G words per row (shift-and-mask may need up to LINE/W - 1 words more)
    const long long span_max = MODE == 1 ? n + LINE / W - 1 : n;
    const long long steps = (span_max + G - 1) / G;
    if (steps == 1) {
        loop_short<W, MODE, DIR, 4, 1>(rows, n_idx, order, dev, row_bytes, n, G, lane, group, n_groups,
                                       block_counts);
    } else if (steps == 2) {
        loop_short<W, MODE, DIR, 2, 2>(rows, n_idx, order, dev, row_bytes, n, G, lane, group, n_groups,
                                       block_counts);
    } else {
        for (long long pos = group; pos < n_idx; pos += n_groups) {
            int state, tier;
            char* trow = rows.find(pos, state, tier);
            count_row(block_counts, tier, lane);
            char* dev_row = dev + (order ? order[pos] : pos) * row_bytes;
            if (state == ROW_COPY) {
                move_row<W, MODE, DIR>(trow, dev_row, n, G, lane);
            } else if (DIR == 0 && state == ROW_ZERO) {
                zero_row<W>(dev_row, n, G, lane);
            }
        }
    }
    if (counts != nullptr) {
        __syncthreads();
        if (threadIdx.x < 3 && block_counts_mem[threadIdx.x]) atomicAdd(&counts[threadIdx.x], block_counts_mem[threadIdx.x]);
    }
}

}  // namespace

#define DP_PLAIN(W, MODE, DIR, NAME, I, ISUF)                                                     \
    extern "C" __global__ void NAME##_w##W##_m##MODE##_##ISUF(                                    \
        char* table, long long n_rows, long long row_stride, long long row_bytes, const I* idx,  \
        const long long* order, long long n_idx, char* dev, int G, long long* err) {             \
        PlainRows<I> rows{table, n_rows, row_stride, idx, err};                                   \
        rows_kernel<W, MODE, DIR>(rows, order, n_idx, dev, row_bytes, G, nullptr);                \
    }

// The circular shift is the default; the other two schemes exist for the ablation and are
// compiled only when asked for (-DDP_ALL_MODES), which keeps the default module quick to build.
#ifdef DP_ALL_MODES
#define DP_MODES(W, DIR, NAME, I, ISUF) \
    DP_PLAIN(W, 0, DIR, NAME, I, ISUF)  \
    DP_PLAIN(W, 1, DIR, NAME, I, ISUF)  \
    DP_PLAIN(W, 2, DIR, NAME, I, ISUF)
#else
#define DP_MODES(W, DIR, NAME, I, ISUF) DP_PLAIN(W, 2, DIR, NAME, I, ISUF)
#endif

#define DP_WIDTHS(DIR, NAME, I, ISUF) \
    DP_MODES(16, DIR, NAME, I, ISUF)  \
    DP_MODES(8, DIR, NAME, I, ISUF)   \
    DP_MODES(4, DIR, NAME, I, ISUF)   \
    DP_MODES(2, DIR, NAME, I, ISUF)   \
    DP_MODES(1, DIR, NAME, I, ISUF)

DP_WIDTHS(0, gather, int, i32)
DP_WIDTHS(0, gather, long long, i64)
DP_WIDTHS(1, scatter, int, i32)
DP_WIDTHS(1, scatter, long long, i64)

// Tiered gathers (circular-shift alignment): out[order[k] or k] = row of slot loc[k].
#define DP_TIERED(W)                                                                                 \
    extern "C" __global__ void tiered_gather_w##W(                                                  \
        char* a, long long a_stride, long long n_a, char* b, long long b_stride, long long n_b,    \
        const int* loc, const long long* order, long long n_idx, char* dev, long long row_bytes,   \
        int G, long long* err, unsigned long long* counts) {                                       \
        TierRows rows{a, a_stride, n_a, b, b_stride, n_b, loc, err};                               \
        rows_kernel<W, 2, 0>(rows, order, n_idx, dev, row_bytes, G, counts);                       \
    }

DP_TIERED(16)
DP_TIERED(8)
DP_TIERED(4)
DP_TIERED(2)
DP_TIERED(1)
