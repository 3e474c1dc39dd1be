// Row-split SpMM (GE-SpMM style): out[r, :] = row_scale[r] * sum_k coef(k) * x[map(indices[k]), :].
//
// Compiled per variant through NVRTC options (DP_KIND, DP_VEC, DP_IDX_64: see agg_common.cuh) and
//   DP_CF       column vectors per lane (1 or 2: "warp merging", two independent loads per edge)
//   DP_UNROLL   neighbours per unrolled step (default 4 / CF)
//
// A team of `dw` lanes (a power of two <= 32, so a team never straddles a warp) owns one
// (row, column chunk); lane l covers the VEC-wide column vectors chunk*dw*VEC*CF + (j*dw + l)*VEC,
// j < CF.  Coalesced row caching: the team loads `dw` consecutive CSR positions at once (one
// index, one source-map entry and one coefficient per lane, coalesced) and hands them round with
// shuffles, so each neighbour costs every lane one vector load of x and no index load.
//
// Row order: agg_rows's teams take rows in the order `order` lists them (nullptr: as stored).  The
// plan's "degree" order (rows by descending length) gives the teams of one warp rows of like length,
// so a warp of several teams (dw < 32) does not idle lanes waiting for its longest row, and long
// rows start first.
//
// Sweep: agg_rows's teams take (row, column chunk) pairs row by row (`by_columns` 0: a row's chunks
// together) or chunk by chunk (1: every row's first column chunk, then every row's second...), so that
// the blocks running at one time read one column strip of x: on a table larger than L2 whose strips
// fit it, each neighbour's strip is read from DRAM once instead of once per row that needs it.
//
// Long rows (more than `cut` edges): every piece of `cut` edges is a team of its own, in one launch: the
// first piece among agg_rows's row teams, the others in the tail blocks that come first in its grid (so
// that they start first).  A piece adds its sum atomically into `part`, an A (float32 / float64) buffer
// of one row per long row (`long_slot`), then counts itself in `count` (one counter per long row and
// column chunk); the team that completes a row's count stores the row into `out` (in T) and puts zeros
// back into its part row and counter, so `part` and `count` are zero again after every launch and are
// kept between calls (one pair per stream).  Short rows are stored straight into `out`: no zeroing, no
// atomics.  The tail's pieces are found from `tail_cum`, the inclusive prefix sum over rows of
// max(0, ceil(deg / cut) - 1), by binary search, so the host never needs their number: the tail blocks
// cover num_edges / cut pieces, an upper bound.

#include "agg_common.cuh"

#ifndef DP_CF
#define DP_CF 1
#endif
#ifndef DP_UNROLL
#define DP_UNROLL (4 / DP_CF)
#endif
constexpr int CF = DP_CF;

namespace {

constexpr int UNROLL = DP_UNROLL;  // neighbours per unrolled step: UNROLL * CF vector loads in flight per lane

__device__ __forceinline__ unsigned team_mask(int dw) {
    if (dw == 32) return 0xffffffffu;
    const int first = (threadIdx.x % 32) / dw * dw;
    return ((1u << dw) - 1u) << first;
}

// CSR position k's source row of x (map(indices[k])) and coefficient (weight * neighbour scale), for the lane
// that loads it; a team loads `dw` positions at once and hands them round with shuffles.
__device__ __forceinline__ void load_position(long long k, const I* __restrict__ indices,
                                              const long long* __restrict__ perm,
                                              const long long* __restrict__ src_map, const A* __restrict__ w,
                                              const A* __restrict__ nbr_scale, long long& s_l, A& c_l) {
    const long long s = static_cast<long long>(indices[k]);
    c_l = 1;
    if (w != nullptr) c_l = w[perm != nullptr ? perm[k] : k];
    if (nbr_scale != nullptr) c_l *= nbr_scale[s];
    s_l = src_map != nullptr ? src_map[s] : s;
}

// acc[q][:] += sum over k in [beg, end) of coef(k) * x[map(indices[k]), col(q) : col(q) + VEC]
__device__ __forceinline__ void team_sum(long long beg, long long end, const I* __restrict__ indices,
                                         const long long* __restrict__ perm, const T* __restrict__ x,
                                         const long long* __restrict__ src_map, const A* __restrict__ w,
                                         const A* __restrict__ nbr_scale, int F, int dw, int lane,
                                         unsigned mask, const int col[CF], A acc[CF][VEC]) {
    for (long long k0 = beg; k0 < end; k0 += dw) {
        const int nb = static_cast<int>(min(static_cast<long long>(dw), end - k0));
        long long s_l = 0;
        A c_l = 0;
        if (lane < nb) load_position(k0 + lane, indices, perm, src_map, w, nbr_scale, s_l, c_l);
        int j = 0;
        for (; j + UNROLL <= nb; j += UNROLL) {
            long long s[UNROLL];
            A c[UNROLL];
            Pack v[UNROLL][CF];  // raw words: converted at the multiply, half the registers for 16-bit T
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                s[u] = __shfl_sync(mask, s_l, j + u, dw);
                c[u] = __shfl_sync(mask, c_l, j + u, dw);
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
#pragma unroll
                for (int q = 0; q < CF; ++q)
                    if (col[q] < F) v[u][q].w = __ldg(reinterpret_cast<const W*>(x + s[u] * F + col[q]));
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
#pragma unroll
                for (int q = 0; q < CF; ++q)
                    if (col[q] < F)
#pragma unroll
                        for (int i = 0; i < VEC; ++i) acc[q][i] += c[u] * to_acc(v[u][q].v[i]);
        }
        for (; j < nb; ++j) {
            const long long s = __shfl_sync(mask, s_l, j, dw);
            const A c = __shfl_sync(mask, c_l, j, dw);
#pragma unroll
            for (int q = 0; q < CF; ++q) {
                if (col[q] < F) {
                    A v[VEC];
                    load_vec(x + s * F + col[q], v);
#pragma unroll
                    for (int i = 0; i < VEC; ++i) acc[q][i] += c * v[i];
                }
            }
        }
    }
}

// This thread's team's (slot, column chunk) among n_slots * chunks, by `by_columns` order (see the header);
// false for a team past the last (the whole team leaves together).
__device__ __forceinline__ bool team_slot(long long block, int dw, long long n_slots, int chunks, int by_columns,
                                          long long& slot, int& chunk) {
    const long long team = block * (blockDim.x / dw) + threadIdx.x / dw;
    if (team >= n_slots * chunks) return false;
    slot = by_columns ? team % n_slots : team / chunks;
    chunk = static_cast<int>(by_columns ? team / n_slots : team % chunks);
    return true;
}

__device__ __forceinline__ void zero_acc(A acc[CF][VEC]) {
#pragma unroll
    for (int q = 0; q < CF; ++q)
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[q][i] = 0;
}

__device__ __forceinline__ void team_columns(int chunk, int dw, int lane, int col[CF]) {
#pragma unroll
    for (int q = 0; q < CF; ++q) col[q] = (chunk * CF * dw + q * dw + lane) * VEC;
}

// A piece of long row `row` (sum in acc, scaled): added into its part row and counted; the team that completes
// the row (its ceil(deg / cut) pieces, this column chunk) stores it into out and zeroes the part row and counter.
__device__ __forceinline__ void add_piece(long long row, long long deg, long long cut, int slot_l, int chunk,
                                          int chunks, int F, int dw, int lane, unsigned mask, const int col[CF],
                                          const A acc[CF][VEC], A* __restrict__ part, int* __restrict__ count,
                                          T* __restrict__ out) {
    A* prow = part + static_cast<long long>(slot_l) * F;
#pragma unroll
    for (int q = 0; q < CF; ++q)
        if (col[q] < F) atomic_add_vec(prow + col[q], acc[q]);
    __threadfence();  // this team's additions are visible before its count
    __syncwarp(mask);
    int* cnt = count + static_cast<long long>(slot_l) * chunks + chunk;
    int seen = 0;
    if (lane == 0) seen = atomicAdd(cnt, 1);
    seen = __shfl_sync(mask, seen, 0, dw);
    if (seen != static_cast<int>((deg + cut - 1) / cut) - 1) return;
    __threadfence();  // the last piece: every other piece's additions are visible (read past L1 below)
#pragma unroll
    for (int q = 0; q < CF; ++q) {
        if (col[q] >= F) continue;
        A v[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
            v[i] = __ldcg(prow + col[q] + i);
            prow[col[q] + i] = 0;
        }
        store_vec(out + row * F + col[q], v);
    }
    if (lane == 0) *cnt = 0;
}

}  // namespace

// Every row's first `cut` edges (blocks from `tail_blocks` on): a short row stored into out; and the further
// pieces of `cut` edges of the long rows (the first `tail_blocks` blocks).  See the header for long rows.
extern "C" __global__ void agg_rows(const long long* __restrict__ indptr, const I* __restrict__ indices,
                                    const long long* __restrict__ perm, long long n_rows, int chunks,
                                    long long cut, const long long* __restrict__ order, int by_columns,
                                    const T* __restrict__ x,
                                    const long long* __restrict__ src_map, const A* __restrict__ w,
                                    const A* __restrict__ nbr_scale, const A* __restrict__ row_scale,
                                    T* __restrict__ out, int F, int dw, long long tail_blocks,
                                    const long long* __restrict__ tail_cum, const int* __restrict__ long_slot,
                                    A* __restrict__ part, int* __restrict__ count) {
    const int lane = threadIdx.x % dw;
    const unsigned mask = team_mask(dw);
    long long row, beg, end;
    int chunk;
    if (blockIdx.x < tail_blocks) {  // a tail piece
        const long long team = static_cast<long long>(blockIdx.x) * (blockDim.x / dw) + threadIdx.x / dw;
        const long long piece = team / chunks;
        if (n_rows <= 0 || piece >= tail_cum[n_rows - 1]) return;
        long long lo = 0, hi = n_rows - 1;  // the first row whose inclusive count exceeds `piece`
        while (lo < hi) {
            const long long mid = (lo + hi) >> 1;
            if (tail_cum[mid] > piece) hi = mid; else lo = mid + 1;
        }
        row = lo;
        const long long first = row ? tail_cum[row - 1] : 0;
        beg = indptr[row] + (piece - first + 1) * cut;
        end = min(indptr[row + 1], beg + cut);
        chunk = static_cast<int>(team % chunks);
        DP_CHECK(beg < end, "agg_rows: a tail piece past its row's end (tail_cum does not match indptr)");
    } else {
        long long slot;
        if (!team_slot(blockIdx.x - tail_blocks, dw, n_rows, chunks, by_columns, slot, chunk)) return;
        row = order != nullptr ? order[slot] : slot;
        DP_CHECK(row >= 0 && row < n_rows, "agg_rows: a row of `order` outside [0, n_rows)");
        beg = indptr[row];
        end = min(indptr[row + 1], beg + cut);
    }
    DP_CHECK(beg >= 0 && beg <= end && end <= indptr[n_rows], "agg_rows: a row's edges outside [0, indptr[n_rows])");
    int col[CF];
    team_columns(chunk, dw, lane, col);
    A acc[CF][VEC];
    zero_acc(acc);
    team_sum(beg, end, indices, perm, x, src_map, w, nbr_scale, F, dw, lane, mask, col, acc);
    const A rs = row_scale != nullptr ? row_scale[row] : A(1);
#pragma unroll
    for (int q = 0; q < CF; ++q)
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[q][i] *= rs;
    const long long deg = indptr[row + 1] - indptr[row];
    DP_CHECK(deg <= cut || part != nullptr, "agg_rows: a row longer than `cut` in a launch planned without long rows "
                                           "(a graph's max_degree bound does not hold)");
    if (deg > cut && part != nullptr) {  // a long row (a launch without tail blocks has none: max_degree <= cut)
        DP_CHECK(long_slot[row] >= 0, "agg_rows: a long row without a buffer slot");
        add_piece(row, deg, cut, long_slot[row], chunk, chunks, F, dw, lane, mask, col, acc, part, count, out);
        return;
    }
#pragma unroll
    for (int q = 0; q < CF; ++q)
        if (col[q] < F) store_vec(out + row * F + col[q], acc[q]);
}

// Several short rows per team: the `rows_per_team` consecutive rows of a slot walked as one run of
// CSR positions (indices, coefficients and each position's row, from `edge_row`, loaded `dw` at a
// time, coalesced; UNROLL loads of x in flight across row ends), each row stored when the run
// leaves it, rows without edges stored as zeros.  No cut: a team takes every edge of its rows, so a
// long row holds its team up (the plan takes this where rows are short, or measured faster).  The row
// order is the stored one; `by_columns` as for agg_rows.
extern "C" __global__ void agg_rows_multi(const long long* __restrict__ indptr, const I* __restrict__ indices,
                                          const long long* __restrict__ perm, long long n_rows, int chunks,
                                          int rows_per_team, const int* __restrict__ edge_row, int by_columns,
                                          const T* __restrict__ x, const long long* __restrict__ src_map,
                                          const A* __restrict__ w, const A* __restrict__ nbr_scale,
                                          const A* __restrict__ row_scale, T* __restrict__ out, int F, int dw) {
    const long long n_slots = (n_rows + rows_per_team - 1) / rows_per_team;
    long long slot;
    int chunk;
    if (!team_slot(blockIdx.x, dw, n_slots, chunks, by_columns, slot, chunk)) return;
    const long long first = slot * rows_per_team;
    const long long last = min(first + rows_per_team, n_rows);  // rows [first, last)
    const int lane = threadIdx.x % dw;
    const unsigned mask = team_mask(dw);
    int col[CF];
    team_columns(chunk, dw, lane, col);
    A acc[CF][VEC];
    zero_acc(acc);
    long long cur = first;
    // store row `cur` (scaled), zero the rows up to `upto` (exclusive) that have no edges, restart at `upto`
    auto flush = [&](long long upto) {
        const A rs = row_scale != nullptr ? row_scale[cur] : A(1);
#pragma unroll
        for (int q = 0; q < CF; ++q) {
            if (col[q] >= F) continue;
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[q][i] *= rs;
            store_vec(out + cur * F + col[q], acc[q]);
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[q][i] = 0;
        }
        for (long long r = cur + 1; r < upto; ++r)
#pragma unroll
            for (int q = 0; q < CF; ++q)
                if (col[q] < F) store_vec(out + r * F + col[q], acc[q]);
        cur = upto;
    };
    const long long beg = indptr[first];
    const long long end = indptr[last];
    DP_CHECK(beg >= 0 && beg <= end && end <= indptr[n_rows], "agg_rows_multi: rows' edges outside [0, E)");
    for (long long k0 = beg; k0 < end; k0 += dw) {
        const int nb = static_cast<int>(min(static_cast<long long>(dw), end - k0));
        long long s_l = 0;
        A c_l = 0;
        int r_l = 0;
        if (lane < nb) {
            load_position(k0 + lane, indices, perm, src_map, w, nbr_scale, s_l, c_l);
            r_l = edge_row[k0 + lane];
            DP_CHECK(r_l >= cur && r_l < last, "agg_rows_multi: edge_row does not match indptr");
        }
        for (int j = 0; j < nb; j += UNROLL) {
            long long s[UNROLL];
            A c[UNROLL];
            int r[UNROLL];
            Pack v[UNROLL][CF];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int src_lane = min(j + u, nb - 1);
                s[u] = __shfl_sync(mask, s_l, src_lane, dw);
                c[u] = __shfl_sync(mask, c_l, src_lane, dw);
                r[u] = __shfl_sync(mask, r_l, src_lane, dw);
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
#pragma unroll
                for (int q = 0; q < CF; ++q)
                    if (j + u < nb && col[q] < F)
                        v[u][q].w = __ldg(reinterpret_cast<const W*>(x + s[u] * F + col[q]));
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                if (j + u >= nb) break;
                if (r[u] != cur) flush(r[u]);  // the run left row `cur` (the same branch for the whole team)
#pragma unroll
                for (int q = 0; q < CF; ++q)
                    if (col[q] < F)
#pragma unroll
                        for (int i = 0; i < VEC; ++i) acc[q][i] += c[u] * to_acc(v[u][q].v[i]);
            }
        }
    }
    flush(last);  // the run's last row, then any rows without edges after it
}
