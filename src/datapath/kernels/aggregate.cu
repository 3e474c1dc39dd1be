// GNN aggregation kernels: neighbor-group SpMM (GNNAdvisor), scatter (atomic / fused push),
// max aggregation, SDDMM (per-edge dot products) and edge softmax.
//
// Compiled per variant through NVRTC options (DP_KIND, DP_VEC, DP_IDX_64: see agg_common.cuh).
//
// Work mapping (GNNAdvisor §4): the CSR rows are cut into neighbor groups of at most
// `ngs` edges (grp_row / grp_beg arrays, built once per graph and cached by the host, or
// implicit: a prefix sum of the groups per row, searched by the kernel; see locate_group).
// A team of `dw` lanes (dimension workers, a power of two <= 32, so teams never straddle
// a warp) owns one group; lane l covers columns [c0 + l*VEC, c0 + l*VEC + VEC) of each
// pass c0 = 0, dw*VEC, ...  Reads of a neighbor row are coalesced vector loads.
// Partial sums of the teams of a block that work on the same row are combined in
// shared memory (warp-aware accumulation); the first team of the run (the leader)
// writes the row, with a plain store when all the row's groups are in the block and
// an atomic add only when they span blocks.

#include "agg_common.cuh"

namespace {
constexpr int UNROLL = 4;
}  // namespace

// Where neighbor group g is.  Explicit groups (grp_row != nullptr): row grp_row[g], first CSR
// position grp_beg[g], for g < n_groups.  Implicit groups (grp_row == nullptr): grp_beg holds
// cum, the inclusive prefix sum over the n_groups *rows* of their group counts (ceil(deg/ngs),
// at least 1), so the host never needs the total; the row is found by binary search and the
// launch may be larger than the groups.  Returns false past the last group; [first, last) is
// the row's range of group ids (implicit groups only).
__device__ __forceinline__ bool locate_group(long long g, const int* __restrict__ grp_row,
                                             const long long* __restrict__ grp_beg, long long n_groups,
                                             const long long* __restrict__ indptr, int ngs, int& row,
                                             long long& beg, long long& first, long long& last) {
    first = last = -1;
    if (grp_row != nullptr) {
        if (g >= n_groups) return false;
        row = grp_row[g];
        beg = grp_beg[g];
        return true;
    }
    if (n_groups <= 0 || g >= grp_beg[n_groups - 1]) return false;
    long long lo = 0, hi = n_groups - 1;
    while (lo < hi) {
        const long long mid = (lo + hi) >> 1;
        if (grp_beg[mid] > g) hi = mid; else lo = mid + 1;
    }
    row = static_cast<int>(lo);
    first = lo ? grp_beg[lo - 1] : 0;
    last = grp_beg[lo];
    beg = indptr[lo] + (g - first) * ngs;
    return true;
}

// Whether group g2 belongs to `row` (see locate_group; first/last from the lookup of a group of `row`).
__device__ __forceinline__ bool group_in_row(long long g2, int row, const int* __restrict__ grp_row,
                                             long long n_groups, long long first, long long last) {
    if (grp_row != nullptr) return g2 >= 0 && g2 < n_groups && grp_row[g2] == row;
    return g2 >= first && g2 < last;
}

// out[r, :] (+)= row_scale[r] * sum_{k in group} coef(k) * x[map(indices[k]), :]
// out is an accumulation buffer (A), zero-initialised by the host.
extern "C" __global__ void agg_pull(const long long* __restrict__ indptr, const I* __restrict__ indices,
                                    const long long* __restrict__ perm, const int* __restrict__ grp_row,
                                    const long long* __restrict__ grp_beg, long long n_groups, int ngs,
                                    const T* __restrict__ x, const long long* __restrict__ src_map,
                                    const A* __restrict__ w, int heads, int head_dim,
                                    const A* __restrict__ nbr_scale, const A* __restrict__ row_scale,
                                    A* __restrict__ out, int F, int dw, int combine) {
    extern __shared__ unsigned char smem_raw[];
    const int teams = blockDim.x / dw;
    const int team = threadIdx.x / dw;
    const int lane = threadIdx.x % dw;
    A* part = reinterpret_cast<A*>(smem_raw);                       // [teams][dw*VEC]
    int* rows_s = reinterpret_cast<int*>(part + (size_t)teams * dw * VEC);  // [teams]

    const long long g = static_cast<long long>(blockIdx.x) * teams + team;
    int row = -1;
    long long beg = 0, end = 0, gfirst, glast;
    const bool valid = locate_group(g, grp_row, grp_beg, n_groups, indptr, ngs, row, beg, gfirst, glast);
    if (valid) end = min(beg + ngs, indptr[row + 1]);
    // Leader / run-length / atomic decisions (uniform per team).
    bool leader = valid;
    int run = 1;
    bool atomic = false;
    if (combine) {
        if (lane == 0) rows_s[team] = row;
        __syncthreads();
        leader = valid && (team == 0 || rows_s[team - 1] != row);
        if (leader) {
            while (team + run < teams && rows_s[team + run] == row) ++run;
            const long long first = static_cast<long long>(blockIdx.x) * teams;
            const bool starts_before = team == 0 && group_in_row(g - 1, row, grp_row, n_groups, gfirst, glast);
            const long long after = g + run;
            const bool ends_after = team + run == teams && group_in_row(after, row, grp_row, n_groups, gfirst, glast);
            atomic = starts_before || ends_after;
            (void)first;
        }
    }
    const A rs = (valid && row_scale != nullptr) ? row_scale[row] : A(1);
    for (int c0 = 0; c0 < F; c0 += dw * VEC) {
        const int col = c0 + lane * VEC;
        const bool active = valid && col < F;
        A acc[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] = 0;
        if (active) {
            const int head = col / head_dim;
            long long k = beg;
            for (; k + UNROLL <= end; k += UNROLL) {
                A v[UNROLL][VEC];
                A c[UNROLL];
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    const long long s = static_cast<long long>(indices[k + u]);
                    const long long src = src_map != nullptr ? src_map[s] : s;
                    c[u] = edge_coef(w, perm, k + u, heads, head, nbr_scale, s);
                    load_vec(x + src * F + col, v[u]);
                }
#pragma unroll
                for (int u = 0; u < UNROLL; ++u)
#pragma unroll
                    for (int i = 0; i < VEC; ++i) acc[i] += c[u] * v[u][i];
            }
            for (; k < end; ++k) {
                const long long s = static_cast<long long>(indices[k]);
                const long long src = src_map != nullptr ? src_map[s] : s;
                const A c = edge_coef(w, perm, k, heads, head, nbr_scale, s);
                A v[VEC];
                load_vec(x + src * F + col, v);
#pragma unroll
                for (int i = 0; i < VEC; ++i) acc[i] += c * v[i];
            }
        }
        if (combine) {
            A* mine = part + (static_cast<size_t>(team) * dw + lane) * VEC;
#pragma unroll
            for (int i = 0; i < VEC; ++i) mine[i] = acc[i];
            __syncthreads();
            if (leader && active) {
                for (int j = 1; j < run; ++j) {
                    const A* other = part + (static_cast<size_t>(team + j) * dw + lane) * VEC;
#pragma unroll
                    for (int i = 0; i < VEC; ++i) acc[i] += other[i];
                }
            }
            __syncthreads();
        }
        if (leader && active) {
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[i] *= rs;
            A* o = out + static_cast<long long>(row) * F + col;
            if (atomic) {
                atomic_add_vec(o, acc);
            } else {
#pragma unroll
                for (int i = 0; i < VEC; ++i) o[i] = acc[i];
            }
        }
    }
}

// Push: for every row r of the CSR, y = in_scale[r] * x[map(r)], then for each neighbor c:
// out[c, :] += coef(k) * y (atomics).  The gradient of x by atomics, and the fused
// gather-aggregate that reads each (host) source row once.  With `align` set, lanes start
// at the 128-byte line below the row start and the row's head is read last (circular
// shift, PyTorch-Direct), so every warp access covers whole aligned lines.
extern "C" __global__ void agg_push(const long long* __restrict__ indptr, const I* __restrict__ indices,
                                    const long long* __restrict__ perm, const int* __restrict__ grp_row,
                                    const long long* __restrict__ grp_beg, long long n_groups, int ngs,
                                    const T* __restrict__ x, const long long* __restrict__ row_map,
                                    const A* __restrict__ w, int heads, int head_dim,
                                    const A* __restrict__ nbr_scale, const A* __restrict__ in_scale,
                                    A* __restrict__ out, int F, int dw, int align) {
    const int teams = blockDim.x / dw;
    const long long g = static_cast<long long>(blockIdx.x) * teams + threadIdx.x / dw;
    const int lane = threadIdx.x % dw;
    int row;
    long long beg, gfirst, glast;
    if (!locate_group(g, grp_row, grp_beg, n_groups, indptr, ngs, row, beg, gfirst, glast)) return;
    const long long end = min(beg + ngs, indptr[row + 1]);
    if (end <= beg) return;  // a row without edges is never read (a host row costs a PCIe read)
    const long long src = row_map != nullptr ? row_map[row] : row;
    const T* xr = x + src * F;
    const int nv = F / VEC;
    int shift = 0;
    if (align) {
        shift = static_cast<int>((reinterpret_cast<unsigned long long>(xr) % 128) / WBYTES);
        if (shift >= nv) shift %= nv;
    }
    const A sc = in_scale != nullptr ? in_scale[row] : A(1);
    for (int q0 = 0; q0 < nv; q0 += dw) {
        const int q = q0 + lane;
        if (q >= nv) break;
        int j = q - shift;
        if (j < 0) j += nv;
        const int col = j * VEC;
        A v[VEC];
        load_vec_sys(xr + col, v);
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[i] *= sc;
        const int head = col / head_dim;
        for (long long k = beg; k < end; ++k) {
            const long long c = static_cast<long long>(indices[k]);
            const A cf = edge_coef(w, perm, k, heads, head, nbr_scale, c);
            A m[VEC];
#pragma unroll
            for (int i = 0; i < VEC; ++i) m[i] = cf * v[i];
            atomic_add_vec(out + c * F + col, m);
        }
    }
}

// Max aggregation, a team per destination row: out[r, f] = max_k coef(k) * x[map(s_k), f]
// and argmax[r, f] = the CSR position of the first maximal edge; empty rows give 0 / -1.
extern "C" __global__ void agg_max(const long long* __restrict__ indptr, const I* __restrict__ indices,
                                   long long n_rows, const T* __restrict__ x,
                                   const long long* __restrict__ src_map, const A* __restrict__ w,
                                   int heads, int head_dim, T* __restrict__ out,
                                   long long* __restrict__ argmax, int F, int dw) {
    const int teams = blockDim.x / dw;
    const long long r = static_cast<long long>(blockIdx.x) * teams + threadIdx.x / dw;
    const int lane = threadIdx.x % dw;
    if (r >= n_rows) return;
    const long long beg = indptr[r], end = indptr[r + 1];
    for (int c0 = 0; c0 < F; c0 += dw * VEC) {
        const int col = c0 + lane * VEC;
        if (col >= F) break;
        const int head = col / head_dim;
        A best[VEC];
        long long arg[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
            best[i] = 0;
            arg[i] = -1;
        }
        for (long long k = beg; k < end; ++k) {
            const long long s = static_cast<long long>(indices[k]);
            const long long src = src_map != nullptr ? src_map[s] : s;
            const A c = edge_coef(w, nullptr, k, heads, head, nullptr, 0);
            A v[VEC];
            load_vec(x + src * F + col, v);
#pragma unroll
            for (int i = 0; i < VEC; ++i) {
                const A m = c * v[i];
                if (arg[i] < 0 || m > best[i]) {
                    best[i] = m;
                    arg[i] = k;
                }
            }
        }
        store_vec(out + r * F + col, best);
#pragma unroll
        for (int i = 0; i < VEC; ++i) argmax[r * F + col + i] = arg[i];
    }
}

// SDDMM: out[k, h] = scale * <a[row, h, :], b[map(indices[k]), h, :]> for every edge k of the
// group's row; scale = row_scale[row] * col_scale[s] when given.  A team of dw lanes per
// group; each (edge, head) dot product is reduced across the team with shuffles.
extern "C" __global__ void sddmm_dot(const long long* __restrict__ indptr, const I* __restrict__ indices,
                                     const int* __restrict__ grp_row, const long long* __restrict__ grp_beg,
                                     long long n_groups, int ngs, const T* __restrict__ a,
                                     const T* __restrict__ b, const long long* __restrict__ b_map,
                                     const A* __restrict__ row_scale, const A* __restrict__ col_scale,
                                     int heads, int head_dim, T* __restrict__ out, int dw) {
    const int teams = blockDim.x / dw;
    const long long g = static_cast<long long>(blockIdx.x) * teams + threadIdx.x / dw;
    const int lane = threadIdx.x % dw;
    // keep whole warps alive for the shuffles; invalid teams compute on row 0 and never write
    int row = 0;
    long long beg = 0, gfirst, glast;
    const bool valid = locate_group(g, grp_row, grp_beg, n_groups, indptr, ngs, row, beg, gfirst, glast);
    if (!valid) row = 0;
    const long long end = valid ? min(beg + ngs, indptr[row + 1]) : 0;
    const int F = heads * head_dim;
    const unsigned mask = dw == 32 ? 0xffffffffu : (((1u << dw) - 1u) << ((threadIdx.x % 32) / dw * dw));
    const A rs = (valid && row_scale != nullptr) ? row_scale[row] : A(1);
    const T* ar = a + static_cast<long long>(row) * F;
    for (long long k = beg; k < end; ++k) {
        const long long s = static_cast<long long>(indices[k]);
        const long long src = b_map != nullptr ? b_map[s] : s;
        const T* br = b + src * F;
        const A sc = rs * (col_scale != nullptr ? col_scale[s] : A(1));
        for (int h = 0; h < heads; ++h) {
            A p = 0;
            for (int c = h * head_dim + lane; c < (h + 1) * head_dim; c += dw) p += to_acc(ar[c]) * to_acc(br[c]);
            for (int off = dw / 2; off > 0; off >>= 1) p += __shfl_xor_sync(mask, p, off, dw);
            if (lane == 0) out[k * heads + h] = from_acc(p * sc);
        }
    }
}

// Edge softmax over the edges of each row, per head: a warp per row.
extern "C" __global__ void edge_softmax_fwd(const long long* __restrict__ indptr, long long n_rows, int heads,
                                            const T* __restrict__ s, T* __restrict__ p) {
    const long long r = static_cast<long long>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (r >= n_rows) return;
    const long long beg = indptr[r], end = indptr[r + 1];
    for (int h = 0; h < heads; ++h) {
        A m = static_cast<A>(__int_as_float(0xff800000));  // -inf
        for (long long k = beg + lane; k < end; k += 32) m = a_max(m, to_acc(s[k * heads + h]));
        for (int off = 16; off > 0; off >>= 1) m = a_max(m, __shfl_xor_sync(0xffffffffu, m, off));
        A z = 0;
        for (long long k = beg + lane; k < end; k += 32) z += a_exp(to_acc(s[k * heads + h]) - m);
        for (int off = 16; off > 0; off >>= 1) z += __shfl_xor_sync(0xffffffffu, z, off);
        const A inv = A(1) / z;
        for (long long k = beg + lane; k < end; k += 32)
            p[k * heads + h] = from_acc(a_exp(to_acc(s[k * heads + h]) - m) * inv);
    }
}

// Its backward: ds = p * (g - sum_row(p * g)).
extern "C" __global__ void edge_softmax_bwd(const long long* __restrict__ indptr, long long n_rows, int heads,
                                            const T* __restrict__ p, const T* __restrict__ gr,
                                            T* __restrict__ ds) {
    const long long r = static_cast<long long>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (r >= n_rows) return;
    const long long beg = indptr[r], end = indptr[r + 1];
    for (int h = 0; h < heads; ++h) {
        A t = 0;
        for (long long k = beg + lane; k < end; k += 32) t += to_acc(p[k * heads + h]) * to_acc(gr[k * heads + h]);
        for (int off = 16; off > 0; off >>= 1) t += __shfl_xor_sync(0xffffffffu, t, off);
        for (long long k = beg + lane; k < end; k += 32) {
            const A pk = to_acc(p[k * heads + h]);
            ds[k * heads + h] = from_acc(pk * (to_acc(gr[k * heads + h]) - t));
        }
    }
}
