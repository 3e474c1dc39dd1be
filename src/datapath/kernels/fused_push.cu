// Fused gather + aggregate from a table in mapped host memory, push style, pipelined.
//
//   out[d, :] += dst_scale[d] * w[e] * src_scale[s] * table[row_map[s], :]   for every edge e = (s -> d)
//
// over the transposed block (a CSR of source rows: t_indptr / t_indices = destinations, perm =
// original edge positions for the weights).  Each table row crosses PCIe once.  A warp owns a
// contiguous run of `order` (the sources sorted by table row, so a warp's reads are close in the
// table and share address translations) and keeps two rows in registers: the next row's load is
// issued before the current row's atomics, so PCIe latency overlaps the scatter.  Rows without
// edges are skipped unread.  Lanes read VEC-wide words starting at the 128-byte line below the
// row (circular shift, PyTorch-Direct), so each warp access covers whole aligned lines.
//
// Options: DP_KIND / DP_VEC / DP_IDX_64 (agg_common.cuh), DP_WPL words per lane (ceil(F / VEC / 32)).

#include "agg_common.cuh"

#ifndef DP_WPL
#define DP_WPL 1
#endif
constexpr int WPL = DP_WPL;

namespace {

struct Row {
    Pack v[WPL];
    int word[WPL];  // the word (VEC elements) of the row each slot holds, -1 for none
};

__device__ __forceinline__ void load_row(const T* xr, int nv, int lane, Row& r) {
    const int shift0 = static_cast<int>((reinterpret_cast<unsigned long long>(xr) % 128) / WBYTES);
    const int shift = shift0 < nv ? shift0 : shift0 % nv;
#pragma unroll
    for (int j = 0; j < WPL; ++j) {
        const int q = j * 32 + lane;
        int word = -1;
        if (q < nv) {
            word = q - shift;
            if (word < 0) word += nv;
            r.v[j].w = *reinterpret_cast<const W*>(xr + static_cast<long long>(word) * VEC);
        }
        r.word[j] = word;
    }
}

}  // namespace

extern "C" __global__ void push_rows(const long long* __restrict__ t_indptr, const I* __restrict__ t_indices,
                                     const long long* __restrict__ perm, const int* __restrict__ order,
                                     long long n_rows, long long rows_per_warp, const long long* __restrict__ row_map,
                                     const T* x, const A* __restrict__ w, const A* __restrict__ src_scale,
                                     const A* __restrict__ dst_scale, A* __restrict__ out, int F) {
    const long long warp = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    const int nv = F / VEC;
    long long i = warp * rows_per_warp;
    const long long i_end = min(n_rows, i + rows_per_warp);
    // find the first row with edges
    long long r_cur = -1, beg = 0, end = 0;
    for (; i < i_end; ++i) {
        const long long r = order[i];
        beg = t_indptr[r];
        end = t_indptr[r + 1];
        if (end > beg) { r_cur = r; ++i; break; }
    }
    if (r_cur < 0) return;
    Row cur, nxt;
    load_row(x + row_map[r_cur] * F, nv, lane, cur);
    while (true) {
        // issue the next row's load before this row's atomics
        long long r_nxt = -1, nbeg = 0, nend = 0;
        for (; i < i_end; ++i) {
            const long long r = order[i];
            nbeg = t_indptr[r];
            nend = t_indptr[r + 1];
            if (nend > nbeg) { r_nxt = r; ++i; break; }
        }
        if (r_nxt >= 0) load_row(x + row_map[r_nxt] * F, nv, lane, nxt);
        const A ss = src_scale != nullptr ? src_scale[r_cur] : A(1);
        for (long long k = beg; k < end; ++k) {
            const long long d = static_cast<long long>(t_indices[k]);
            A c = ss;
            if (w != nullptr) c *= w[perm != nullptr ? perm[k] : k];
            if (dst_scale != nullptr) c *= dst_scale[d];
            A* o = out + d * F;
#pragma unroll
            for (int j = 0; j < WPL; ++j) {
                if (cur.word[j] < 0) continue;
                A m[VEC];
#pragma unroll
                for (int e = 0; e < VEC; ++e) m[e] = c * to_acc(cur.v[j].v[e]);
                atomic_add_vec(o + cur.word[j] * VEC, m);
            }
        }
        if (r_nxt < 0) break;
        cur = nxt;
        r_cur = r_nxt;
        beg = nbeg;
        end = nend;
    }
}
