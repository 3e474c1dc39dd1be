// Zero-copy row gather and scatter between pinned host memory and GPU memory.
//
// The table lives in pinned, GPU-mapped host memory; every read or write of it
// crosses PCIe.  PCIe requests are most efficient when each warp-wide access
// covers whole, aligned 128-byte lines.  A row that starts at a misaligned
// address would make every warp access straddle two lines.  Three access
// schemes are compiled, selected by MODE:
//
//   0  unaligned:      lane j reads word (k*G + j) of the row from the row start;
//   1  shift-and-mask: lanes start at the 128-byte line below the row start and
//                      the lanes that fall before the row start or after its end
//                      idle (DGL's UVA gather);
//   2  circular shift: like 1, but the lanes that fall before the row start
//                      take the row's last words instead, so no lane idles and
//                      each row takes ceil(words / G) steps (PyTorch-Direct).
//
// A group of G lanes (G a power of two <= 32) handles one row at a time; for
// rows of fewer than 32 words a warp holds several groups.  Words are W bytes
// (W = 16, 8, 4, 2 or 1), the widest that divides the row size, the row stride
// and both base addresses.  Each lane keeps UNROLL loads in flight before it
// stores them, so there are enough bytes in flight to cover PCIe latency.
//
// Locality: when `order` is given, the indices arrive sorted and order[k] is the
// position of sorted index k in the caller's index array (its output row).
// Consecutive warps then read nearby table rows, which share address
// translations: random rows from a table of many GB otherwise cost a
// translation miss each, and that, not PCIe, limits small rows.
//
// Bounds: an index i is valid in [-n_rows, n_rows) (negatives wrap, as in
// PyTorch).  An invalid index never reaches memory: the gather writes zeros
// into that output row, the scatter skips it, and the bad value is stored in
// *err so the host can raise IndexError.

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

// Resolve index number `pos` (with PyTorch's negative wrap); returns -1 when
// out of range after recording the bad value.
template <typename I>
__device__ __forceinline__ long long resolve(const I* __restrict__ idx, long long pos,
                                             long long n_rows, long long* err) {
    long long i = static_cast<long long>(idx[pos]);
    long long r = i < 0 ? i + n_rows : i;
    if (r < 0 || r >= n_rows) {
        *err = i;  // any one bad value will do; plain store, last writer wins
        return -1;
    }
    return r;
}

// Map step position q (0 <= q < span) of a row to its word number, or -1 for
// an idle lane.  `shift` is the number of words between the 128-byte line
// below the row start and the row start.
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
__device__ __forceinline__ long long span_of(long long n, long long shift) {
    return MODE == 1 ? n + shift : n;
}

// One group of G lanes moves one row. DIR 0: host table -> device out (gather);
// DIR 1: device rows -> host table (scatter).  `host_row` points at the table row,
// `dev_row` at the contiguous device row.
template <int W, int MODE, int DIR>
__device__ __forceinline__ void move_row(char* host_row, char* dev_row, long long n, int G, int lane) {
    using T = typename Word<W>::T;
    const long long shift =
        MODE == 0 ? 0 : static_cast<long long>((reinterpret_cast<uintptr_t>(host_row) % LINE) / W);
    const long long span = span_of<W, MODE>(n, shift);
    T* h = reinterpret_cast<T*>(host_row);
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
            if (w[u] >= 0) v[u] = DIR == 0 ? h[w[u]] : d[w[u]];
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (w[u] >= 0) {
                if (DIR == 0) d[w[u]] = v[u]; else h[w[u]] = v[u];
            }
        }
    }
}

template <int W, int MODE, int DIR, typename I>
__device__ void rows_kernel(char* __restrict__ table, long long n_rows, long long row_stride,
                            long long row_bytes, const I* __restrict__ idx,
                            const long long* __restrict__ order, long long n_idx,
                            char* __restrict__ dev, int G, long long* err) {
    const long long n = row_bytes / W;  // words per row
    const int lane = threadIdx.x % G;
    const long long groups_per_block = blockDim.x / G;
    const long long group = static_cast<long long>(blockIdx.x) * groups_per_block + threadIdx.x / G;
    const long long n_groups = static_cast<long long>(gridDim.x) * groups_per_block;
    for (long long pos = group; pos < n_idx; pos += n_groups) {
        long long r = resolve(idx, pos, n_rows, err);
        char* dev_row = dev + (order ? order[pos] : pos) * row_bytes;
        if (r < 0) {
            if (DIR == 0) {  // never read: zero the output row
                using T = typename Word<W>::T;
                T* d = reinterpret_cast<T*>(dev_row);
                for (long long q = lane; q < n; q += G) d[q] = zero_word<W>();
            }
            continue;
        }
        move_row<W, MODE, DIR>(table + r * row_stride, dev_row, n, G, lane);
    }
}

}  // namespace

#define DP_DEFINE(W, MODE, DIR, NAME, I, ISUF)                                                   \
    extern "C" __global__ void NAME##_w##W##_m##MODE##_##ISUF(                                   \
        char* table, long long n_rows, long long row_stride, long long row_bytes, const I* idx, \
        const long long* order, long long n_idx, char* dev, int G, long long* err) {            \
        rows_kernel<W, MODE, DIR, I>(table, n_rows, row_stride, row_bytes, idx, order, n_idx,  \
                                     dev, G, err);                                              \
    }

#define DP_MODES(W, DIR, NAME, I, ISUF) \
    DP_DEFINE(W, 0, DIR, NAME, I, ISUF) \
    DP_DEFINE(W, 1, DIR, NAME, I, ISUF) \
    DP_DEFINE(W, 2, DIR, NAME, I, ISUF)

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
