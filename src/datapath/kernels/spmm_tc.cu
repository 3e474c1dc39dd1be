// Tensor-core SpMM after TC-GNN's sparse graph translation (SGT).
//
// The destination rows are cut into windows of 16 rows.  Within a window the distinct source
// columns that any of its rows uses are condensed, in ascending order, into blocks of KB
// columns (KB = 16 for half / bfloat16, mma.m16n8k16; KB = 8 for tf32, mma.m16n8k8): each
// block is a dense 16 x KB tile of the adjacency times the KB x F slab of x formed by its
// columns' rows.  The host builds the translation once per graph (datapath.ops._sgt):
//
//   win_ptr  (n_windows+1,) int64  blocks of each window
//   blk_col  (n_blocks, KB) int32   source id of each tile column, -1 for padding
//   blk_eptr (n_blocks+1,) int64   the block's edges in the block-sorted edge arrays
//   e_slot   (E,) uint8            (row % 16) * KB + tile column of each sorted edge
//   e_id     (E,) int64            its original CSR position (edge weights), or null
//
// One CTA per (window, column tile of NW * NT * 8 columns); warp w owns NT 8-column tiles.
// Per block: the CTA zeroes the fp32 tile, adds every edge's value into it (duplicate edges sum;
// value = weight * nbr_scale[column]), loads the KB source rows of its column tile into shared
// memory with VEC-wide loads, then each warp runs NT mma.sync on the tile.  Accumulation is in
// fp32 registers; the epilogue scales by row_scale and stores the window's rows (no atomics:
// a window owns its rows).
//
// Options: DP_KIND 1 / 2 (half / bfloat16 operands) or 0 (float features as tf32), DP_VEC
// (vector width of the x loads), DP_NT (8-column tiles per warp: 1, 2 or 4).

#include "agg_common.cuh"

#ifndef DP_NT
#define DP_NT 2
#endif
constexpr int NT = DP_NT;
constexpr int WIN = 16;
#if DP_KIND == 0
constexpr int KB = 8;
#else
constexpr int KB = 16;
#endif
constexpr int XPAD = 16 / (int)sizeof(T);  // one 16-byte pad per tile row: no bank conflicts between rows

namespace {

#if DP_KIND == 0
__device__ __forceinline__ unsigned tf32_of(float v) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
    return r;
}
#else
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    return static_cast<unsigned>(from_acc(lo)) | (static_cast<unsigned>(from_acc(hi)) << 16);
}
__device__ __forceinline__ unsigned pack2_raw(T lo, T hi) {
    return static_cast<unsigned>(lo) | (static_cast<unsigned>(hi) << 16);
}
#endif

__device__ __forceinline__ void mma(float c[4], const unsigned a[4], const unsigned b[2]) {
#if DP_KIND == 0
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#elif DP_KIND == 1
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

}  // namespace

extern "C" __global__ void spmm_tc(const long long* __restrict__ win_ptr, const int* __restrict__ blk_col,
                                   const long long* __restrict__ blk_eptr,
                                   const unsigned char* __restrict__ e_slot, const long long* __restrict__ e_id,
                                   long long n_rows, const T* __restrict__ x, const A* __restrict__ w,
                                   const A* __restrict__ nbr_scale, const A* __restrict__ row_scale,
                                   T* __restrict__ out, int F) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int nw = blockDim.x / 32;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int ct = nw * NT * 8;           // columns of the CTA's tile
    const int xs = ct + XPAD;             // elements per shared row of x
    const int c0 = blockIdx.y * ct;
    const long long win = blockIdx.x;

    T* Xs = reinterpret_cast<T*>(smem_raw);                              // [KB][xs]
    float* As = reinterpret_cast<float*>(Xs + KB * xs);                  // [WIN][KB]
    int* cols = reinterpret_cast<int*>(As + WIN * KB);                   // [KB]

    float acc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[n][i] = 0.f;

    const int words = ct / VEC;  // VEC-wide words per tile row
    const long long b_end = win_ptr[win + 1];
    for (long long b = win_ptr[win]; b < b_end; ++b) {
        for (int i = threadIdx.x; i < WIN * KB; i += blockDim.x) As[i] = 0.f;
        if (threadIdx.x < KB) cols[threadIdx.x] = blk_col[b * KB + threadIdx.x];
        __syncthreads();
        for (long long e = blk_eptr[b] + threadIdx.x; e < blk_eptr[b + 1]; e += blockDim.x) {
            const int slot = e_slot[e];
            float v = 1.f;
            if (w != nullptr) v = static_cast<float>(w[e_id[e]]);
            if (nbr_scale != nullptr) v *= static_cast<float>(nbr_scale[cols[slot % KB]]);
            atomicAdd(As + slot, v);
        }
        for (int i = threadIdx.x; i < KB * words; i += blockDim.x) {
            const int k = i / words;
            const int col = c0 + (i % words) * VEC;
            const long long s = cols[k];
            W v;
            if (s >= 0 && col < F) {
                v = __ldg(reinterpret_cast<const W*>(x + s * F + col));
            } else {
                Pack z;
#pragma unroll
                for (int j = 0; j < VEC; ++j) z.v[j] = T(0);
                v = z.w;
            }
            *reinterpret_cast<W*>(Xs + k * xs + (i % words) * VEC) = v;
        }
        __syncthreads();
        unsigned a[4];
#if DP_KIND == 0
        a[0] = tf32_of(As[g * KB + t]);
        a[1] = tf32_of(As[(g + 8) * KB + t]);
        a[2] = tf32_of(As[g * KB + t + 4]);
        a[3] = tf32_of(As[(g + 8) * KB + t + 4]);
#else
        a[0] = pack2(As[g * KB + 2 * t], As[g * KB + 2 * t + 1]);
        a[1] = pack2(As[(g + 8) * KB + 2 * t], As[(g + 8) * KB + 2 * t + 1]);
        a[2] = pack2(As[g * KB + 2 * t + 8], As[g * KB + 2 * t + 9]);
        a[3] = pack2(As[(g + 8) * KB + 2 * t + 8], As[(g + 8) * KB + 2 * t + 9]);
#endif
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const int nc = (warp * NT + n) * 8 + g;  // this lane's column of the 8-column tile
            unsigned bf[2];
#if DP_KIND == 0
            bf[0] = tf32_of(Xs[t * xs + nc]);
            bf[1] = tf32_of(Xs[(t + 4) * xs + nc]);
#else
            bf[0] = pack2_raw(Xs[(2 * t) * xs + nc], Xs[(2 * t + 1) * xs + nc]);
            bf[1] = pack2_raw(Xs[(2 * t + 8) * xs + nc], Xs[(2 * t + 9) * xs + nc]);
#endif
            mma(acc[n], a, bf);
        }
        __syncthreads();
    }
    // epilogue: c0,c1 -> (row g, cols 2t, 2t+1); c2,c3 -> (row g + 8, same cols)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const long long row = win * WIN + g + 8 * h;
        if (row >= n_rows) continue;
        const float rs = row_scale != nullptr ? static_cast<float>(row_scale[row]) : 1.f;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const int col = c0 + (warp * NT + n) * 8 + 2 * t;
#pragma unroll
            for (int j = 0; j < 2; ++j)
                if (col + j < F) out[row * F + col + j] = from_acc(acc[n][2 * h + j] * rs);
        }
    }
}
