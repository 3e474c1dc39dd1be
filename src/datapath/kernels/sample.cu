// Uniform neighbor sampling over a CSR of in-neighbours, for GNN mini-batches.
//
// One warp per destination node.  The graph (indptr, indices, optional edge ids)
// is read through plain pointers: GPU memory, or pinned host memory mapped into
// the GPU's address space (unified memory; every read crosses PCIe).
//
// For destination i (node v = dst[i], degree d, fanout k), the warp writes up to
// k sampled source ids into out_nbr[i*k : i*k+k] (padded layout) and the count
// into out_cnt[i]:
//   - d == 0: nothing;
//   - with replacement: k draws, each uniform over the d neighbours;
//   - without replacement, d <= k: all d neighbours in CSR order;
//   - without replacement, d > k: a uniform k-subset by Floyd's algorithm (for
//     j = d-k .. d-1: t = uniform in [0, j]; take j if t was already taken, else t),
//     in the order Floyd picks them.  The warp checks membership in parallel.
// Rows i in [n_dst, capacity) get out_cnt[i] = 0, so the padded arrays can be
// processed without knowing n_dst on the host (n_dst is read from device memory).
//
// Random numbers are counter-based (SplitMix64 finalizer), a pure function of
// (key, node, step): draw(step) = mix64(mix64(key ^ v) ^ step); an integer in
// [0, n) is ((draw >> 32) * n) >> 32.  datapath/loaders/_rng.py computes the same
// bits on the CPU, so both paths produce identical samples.  Degrees must stay
// below 2^32 (the host checks).  With key_ptr non-null the key is read from device
// memory instead of the key argument (a CUDA graph replays one launch for every batch:
// its key changes in memory, not in the launch).

typedef unsigned long long u64;

namespace {

__device__ __forceinline__ u64 mix64(u64 z) {
  z += 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

__device__ __forceinline__ long long draw_below(u64 state, u64 step, long long bound) {
  const u64 r = mix64(state ^ step);
  return (long long)(((r >> 32) * (u64)bound) >> 32);
}

template <typename IP, typename IX>
__device__ __forceinline__ void sample_rows(
    const IP* __restrict__ indptr, const IX* __restrict__ indices, const long long* __restrict__ eids,
    const long long* __restrict__ dst, const long long* __restrict__ n_dst_ptr, long long capacity,
    int k, int replace, u64 key, long long* __restrict__ out_nbr, long long* __restrict__ out_eid,
    long long* __restrict__ out_cnt, const u64* __restrict__ key_ptr) {
  const int lane = threadIdx.x & 31;
  const long long n_warps = ((long long)gridDim.x * blockDim.x) >> 5;
  if (key_ptr) key = *key_ptr;
  const long long n = *n_dst_ptr;
  for (long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; i < capacity; i += n_warps) {
    if (i >= n) {
      if (lane == 0) out_cnt[i] = 0;
      continue;
    }
    const long long v = dst[i];
    const long long start = (long long)indptr[v];
    const long long d = (long long)indptr[v + 1] - start;
    long long* out = out_nbr + i * (long long)k;
    long long* oe = out_eid ? out_eid + i * (long long)k : nullptr;
    const u64 state = mix64(key ^ (u64)v);
    long long cnt;
    if (d <= 0) {
      cnt = 0;
    } else if (replace) {
      cnt = k;
      for (int j = lane; j < k; j += 32) {
        const long long p = start + draw_below(state, (u64)j, d);
        out[j] = (long long)indices[p];
        if (oe) oe[j] = eids ? eids[p] : p;
      }
    } else if (d <= k) {
      cnt = d;
      for (long long j = lane; j < d; j += 32) {
        out[j] = (long long)indices[start + j];
        if (oe) oe[j] = eids ? eids[start + j] : start + j;
      }
    } else {
      cnt = k;
      // Floyd: out[0..s) holds the positions taken so far (scratch, replaced below).
      for (int s = 0; s < k; ++s) {
        const long long jj = d - k + s;
        const long long t = draw_below(state, (u64)s, jj + 1);
        bool found = false;
        for (int q = lane; q < s; q += 32) found |= (out[q] == t);
        found = __any_sync(0xffffffffu, found);
        if (lane == 0) out[s] = found ? jj : t;
        __syncwarp();
      }
      for (int j = lane; j < k; j += 32) {
        const long long p = start + out[j];
        out[j] = (long long)indices[p];
        if (oe) oe[j] = eids ? eids[p] : p;
      }
    }
    if (lane == 0) out_cnt[i] = cnt;
    __syncwarp();
  }
}

}  // namespace

#define DEFINE_SAMPLE(NAME, IP, IX)                                                                      \
  extern "C" __global__ void NAME(                                                                        \
      const IP* indptr, const IX* indices, const long long* eids, const long long* dst,                   \
      const long long* n_dst_ptr, long long capacity, int k, int replace, u64 key, long long* out_nbr,    \
      long long* out_eid, long long* out_cnt, const u64* key_ptr) {                                       \
    sample_rows<IP, IX>(indptr, indices, eids, dst, n_dst_ptr, capacity, k, replace, key, out_nbr,        \
                        out_eid, out_cnt, key_ptr);                                                       \
  }

DEFINE_SAMPLE(sample_neighbors_i32_i32, int, int)
DEFINE_SAMPLE(sample_neighbors_i32_i64, int, long long)
DEFINE_SAMPLE(sample_neighbors_i64_i32, long long, int)
DEFINE_SAMPLE(sample_neighbors_i64_i64, long long, long long)
