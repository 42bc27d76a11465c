// Host/device qualifiers of the per-element helpers (common/e2m1.cuh, common/convert.cuh, dequantize/decode.cuh),
// which both the CUDA kernels (nvcc) and the CPU handlers (the host C++ compiler, cpp/cpu/) compile: one definition
// of every E2M1 / E4M3 / E5M2 / E8M0 rounding. Device paths use the PTX intrinsics under __CUDA_ARCH__; the host path
// of each helper is a portable, bit-identical form (IEEE binary32 with subnormals kept: the CPU handlers clear the
// FTZ / DAZ modes and are built with -ffp-contract=off, no -ffast-math).
#pragma once

#if defined(__CUDACC__)
#define JF4_HD __host__ __device__ __forceinline__
#else
#define JF4_HD inline
#endif
// `#pragma unroll` for the device pass only (the host compiler does not know it and warns under -Wall).
#if defined(__CUDA_ARCH__)
#define JF4_UNROLL _Pragma("unroll")
#else
#define JF4_UNROLL
#endif
