// The visit order of a sorted row gather: the indices grouped by bucket (a counting sort on
// key >> shift, about one bucket per key), buckets ascending, with each key's position in
// the call.  The Python side is `datapath.memory._order`.
//
// A full radix sort of 262K int64 keys takes 110 us of an H100; the counting sort 28 us.
// Done as four launches (zero the histogram, count, cumulative sum, place) it also costs
// ~100 us of host time, which a gather from an idle GPU waits for.  `bucket_order_*` does
// the four steps in one cooperative launch (every block resident), separated by a grid
// barrier; `bucket_count_*` / `bucket_place_*` are the steps of the four-launch form.
//
// Keys take the plain gather's wrap rule (negatives + n_keys); a key outside [0, n_keys)
// goes to the last bucket and is reported by the row kernel that visits it.  Lanes of a
// warp with the same bucket share one atomic (sorted or repeated keys would otherwise
// serialise on one counter).  Inside a bucket the order is not fixed.
namespace {

template <typename I>
__device__ __forceinline__ unsigned int bucket_of(I v, long long n_keys, int shift, unsigned int n_buckets) {
    long long r = static_cast<long long>(v);
    if (r < 0) r += n_keys;
    if (r < 0 || r >= n_keys) return n_buckets - 1;
    return static_cast<unsigned int>(r >> shift);
}

// PLACE false: slots[b] += keys in bucket b.  PLACE true: slots[b] holds bucket b's end;
// each key takes a position below it (slots[b] ends at the bucket's start).
template <typename I, bool PLACE>
__device__ void bucket_pass(const I* __restrict__ keys, long long m, long long n_keys, int shift,
                            unsigned int n_buckets, unsigned int* __restrict__ slots, I* __restrict__ sorted,
                            long long* __restrict__ order) {
    const int lane = threadIdx.x & 31;
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    // w0 is the same for every lane of a warp, so whole warps run the loop together
    for (long long w0 = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x - lane; w0 < m; w0 += stride) {
        const long long i = w0 + lane;
        const bool ok = i < m;
        const unsigned int active = __ballot_sync(0xffffffffu, ok);
        if (!ok) continue;
        const I key = keys[i];
        const unsigned int b = bucket_of(key, n_keys, shift, n_buckets);
        const unsigned int peers = __match_any_sync(active, b);
        const int leader = __ffs(peers) - 1;
        const unsigned int below = peers & ((1u << lane) - 1u);
        if (!PLACE) {
            if (lane == leader) atomicAdd(&slots[b], static_cast<unsigned int>(__popc(peers)));
        } else {
            unsigned int end = 0;
            if (lane == leader) end = atomicSub(&slots[b], static_cast<unsigned int>(__popc(peers)));
            end = __shfl_sync(peers, end, leader);
            const unsigned int pos = end - 1u - static_cast<unsigned int>(__popc(below));
            sorted[pos] = key;
            order[pos] = i;
        }
    }
}

// Every block of the grid waits here until all have arrived.  Valid only when every block is
// resident at once (a cooperative launch guarantees it).  bar[0] counts arrivals and is back
// at 0 when the barrier opens; bar[1] is the generation the waiting blocks watch.
__device__ __forceinline__ void grid_barrier(unsigned int* bar) {
    __syncthreads();
    if (threadIdx.x == 0) {
        volatile unsigned int* gen = bar + 1;
        const unsigned int seen = *gen;
        __threadfence();
        if (atomicAdd(bar, 1u) == gridDim.x - 1) {
            atomicExch(bar, 0u);
            __threadfence();
            atomicAdd(bar + 1, 1u);
        } else {
            while (*gen == seen) __nanosleep(64);
        }
        __threadfence();
    }
    __syncthreads();
}

// Exclusive prefix sum of v over the block (blockDim.x a multiple of 32, at most 1024); the
// block's total in *total.
__device__ __forceinline__ unsigned int block_exclusive_scan(unsigned int v, unsigned int* total) {
    __shared__ unsigned int warp_sums[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    unsigned int x = v;
    for (int d = 1; d < 32; d <<= 1) {
        const unsigned int y = __shfl_up_sync(0xffffffffu, x, d);
        if (lane >= d) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        unsigned int s = lane < n_warps ? warp_sums[lane] : 0u;
        for (int d = 1; d < 32; d <<= 1) {
            const unsigned int y = __shfl_up_sync(0xffffffffu, s, d);
            if (lane >= d) s += y;
        }
        if (lane < n_warps) warp_sums[lane] = s;  // inclusive sums of the warps
    }
    __syncthreads();
    const unsigned int before = (warp ? warp_sums[warp - 1] : 0u) + x - v;
    *total = warp_sums[n_warps - 1];
    __syncthreads();  // warp_sums is reused by the next call
    return before;
}

// hist: n_buckets + gridDim.x words of scratch (no initial value needed); bar: two words,
// bar[0] == 0 before the launch (it is 0 again after it).
template <typename I>
__device__ void bucket_order_fused(const I* __restrict__ keys, long long m, long long n_keys, int shift,
                                   unsigned int n_buckets, unsigned int* hist, unsigned int* bar,
                                   I* __restrict__ sorted, long long* __restrict__ order) {
    const long long n_threads = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long b = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; b < n_buckets; b += n_threads)
        hist[b] = 0u;
    grid_barrier(bar);
    bucket_pass<I, false>(keys, m, n_keys, shift, n_buckets, hist, nullptr, nullptr);
    grid_barrier(bar);
    // hist -> inclusive ends: block j scans buckets [j * chunk, (j + 1) * chunk), each thread a
    // contiguous piece of them; the blocks' totals give each block its offset
    unsigned int* totals = hist + n_buckets;
    const unsigned int chunk = (n_buckets + gridDim.x - 1) / gridDim.x;
    const unsigned int lo = min(blockIdx.x * chunk, n_buckets), hi = min(lo + chunk, n_buckets);
    const unsigned int per = (chunk + blockDim.x - 1) / blockDim.x;
    const unsigned int t_lo = min(lo + threadIdx.x * per, hi), t_hi = min(t_lo + per, hi);
    unsigned int mine = 0;
    for (unsigned int b = t_lo; b < t_hi; ++b) mine += __ldcg(hist + b);
    unsigned int block_total = 0;
    const unsigned int before = block_exclusive_scan(mine, &block_total);
    if (threadIdx.x == 0) totals[blockIdx.x] = block_total;
    grid_barrier(bar);
    unsigned int earlier = 0;
    for (unsigned int j = threadIdx.x; j < blockIdx.x; j += blockDim.x) earlier += __ldcg(totals + j);
    unsigned int all_earlier = 0;
    block_exclusive_scan(earlier, &all_earlier);
    unsigned int run = all_earlier + before;
    for (unsigned int b = t_lo; b < t_hi; ++b) {
        run += __ldcg(hist + b);
        hist[b] = run;
    }
    grid_barrier(bar);
    bucket_pass<I, true>(keys, m, n_keys, shift, n_buckets, hist, sorted, order);
}

}  // namespace

#define DP_BUCKETS(I, ISUF)                                                                              \
    extern "C" __global__ void bucket_count_##ISUF(const I* keys, long long m, long long n_keys, int shift, \
                                                   unsigned int n_buckets, unsigned int* counts) {          \
        bucket_pass<I, false>(keys, m, n_keys, shift, n_buckets, counts, nullptr, nullptr);              \
    }                                                                                                   \
    extern "C" __global__ void bucket_place_##ISUF(const I* keys, long long m, long long n_keys, int shift, \
                                                   unsigned int n_buckets, unsigned int* ends, I* sorted,   \
                                                   long long* order) {                                   \
        bucket_pass<I, true>(keys, m, n_keys, shift, n_buckets, ends, sorted, order);                    \
    }                                                                                                   \
    extern "C" __global__ void bucket_order_##ISUF(const I* keys, long long m, long long n_keys, int shift, \
                                                   unsigned int n_buckets, unsigned int* hist,              \
                                                   unsigned int* bar, I* sorted, long long* order) {        \
        bucket_order_fused<I>(keys, m, n_keys, shift, n_buckets, hist, bar, sorted, order);              \
    }

DP_BUCKETS(int, i32)
DP_BUCKETS(long long, i64)
