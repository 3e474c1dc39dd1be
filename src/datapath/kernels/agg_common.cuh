// Shared by the aggregation kernels (aggregate.cu, spmm_rows.cu, spmm_tc.cu): element and
// index types chosen by NVRTC options, conversions, vector loads and stores, atomics.
//
//   DP_KIND    element type of the features: 0 float, 1 half, 2 bfloat16, 3 double
//   DP_VEC     elements per vector load (VEC * sizeof(T) <= 16 bytes)
//   DP_IDX_64  defined: the CSR `indices` are int64 (else int32)
//
// Accumulation is in float (double for DP_KIND 3).  Half and bfloat16 are handled as raw
// 16-bit words converted with PTX cvt, so no CUDA headers are needed.
#pragma once

#ifndef DP_KIND
#define DP_KIND 0
#endif
#ifndef DP_VEC
#define DP_VEC 1
#endif

#if DP_KIND == 0
typedef float T;
typedef float A;
#elif DP_KIND == 3
typedef double T;
typedef double A;
#else
typedef unsigned short T;
typedef float A;
#endif
#ifdef DP_IDX_64
typedef long long I;
#else
typedef int I;
#endif
constexpr int VEC = DP_VEC;

// Kernel preconditions, checked in debug builds only (-DDP_DEBUG, `datapath.ops.debug_checks`): a failed check
// prints what failed and traps (the launch fails with an error instead of reading or writing out of bounds).
#ifdef DP_DEBUG
#define DP_CHECK(cond, what)                                                                             \
    do {                                                                                                 \
        if (!(cond)) {                                                                                   \
            printf("datapath kernel precondition failed: %s (block %d, thread %d)\n", what, (int)blockIdx.x, \
                   (int)threadIdx.x);                                                                    \
            __trap();                                                                                    \
        }                                                                                                \
    } while (0)
#else
#define DP_CHECK(cond, what) \
    do {                     \
    } while (0)
#endif
constexpr int WBYTES = VEC * (int)sizeof(T);

namespace {

template <int B> struct Word;
template <> struct Word<16> { typedef uint4 type; };
template <> struct Word<8> { typedef uint2 type; };
template <> struct Word<4> { typedef unsigned int type; };
template <> struct Word<2> { typedef unsigned short type; };
typedef typename Word<WBYTES>::type W;

union Pack {
    W w;
    T v[VEC];
};

__device__ __forceinline__ A to_acc(T v) {
#if DP_KIND == 1
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
    return f;
#elif DP_KIND == 2
    return __uint_as_float(static_cast<unsigned int>(v) << 16);
#else
    return v;
#endif
}

__device__ __forceinline__ T from_acc(A v) {
#if DP_KIND == 1
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return h;
#elif DP_KIND == 2
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return h;
#else
    return v;
#endif
}

// Read-only (non-coherent) vector load: features in GPU memory that no kernel writes meanwhile.
__device__ __forceinline__ void load_vec(const T* __restrict__ p, A out[VEC]) {
    Pack pk;
    pk.w = __ldg(reinterpret_cast<const W*>(p));
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[i] = to_acc(pk.v[i]);
}

// Plain (coherent) load, for rows that may live in mapped host memory.
__device__ __forceinline__ void load_vec_sys(const T* p, A out[VEC]) {
    Pack pk;
    pk.w = *reinterpret_cast<const W*>(p);
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[i] = to_acc(pk.v[i]);
}

__device__ __forceinline__ void store_vec(T* p, const A in[VEC]) {
    Pack pk;
#pragma unroll
    for (int i = 0; i < VEC; ++i) pk.v[i] = from_acc(in[i]);
    *reinterpret_cast<W*>(p) = pk.w;
}

__device__ __forceinline__ void atomic_add_vec(A* p, const A v[VEC]) {
#if DP_KIND != 3 && __CUDA_ARCH__ >= 900
    if constexpr (VEC == 4) {
        atomicAdd(reinterpret_cast<float4*>(p), make_float4(v[0], v[1], v[2], v[3]));
    } else if constexpr (VEC == 2) {
        atomicAdd(reinterpret_cast<float2*>(p), make_float2(v[0], v[1]));
    } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) atomicAdd(p + i, v[i]);
    }
#else
#pragma unroll
    for (int i = 0; i < VEC; ++i) atomicAdd(p + i, v[i]);
#endif
}

// The per-edge multiplier: weight[e, head] * nbr_scale[neighbor] (1 when absent).
__device__ __forceinline__ A edge_coef(const A* __restrict__ w, const long long* __restrict__ perm,
                                       long long k, int heads, int head, const A* __restrict__ nbr_scale,
                                       long long nbr) {
    A c = 1;
    if (w != nullptr) {
        long long e = perm != nullptr ? perm[k] : k;
        c = w[e * heads + head];
    }
    if (nbr_scale != nullptr) c *= nbr_scale[nbr];
    return c;
}

__device__ __forceinline__ A a_exp(A v) {
#if DP_KIND == 3
    return exp(v);
#else
    return expf(v);
#endif
}

__device__ __forceinline__ A a_max(A a, A b) { return a > b ? a : b; }

}  // namespace
