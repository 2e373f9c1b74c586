// stoker's GPU kernels: each entry of kernels.inc as a __global__ function over the bodies
// in ops/, compiled by nvcc (build.rs, `cuda` feature) for sm_90 with --fmad=false, and
// loaded through cudarc. Launch shapes: element and pack kernels any grid (grid-stride
// loops over elements, or packs of eight); row kernels one warp per row (grid-stride over
// rows); warp kernels exactly `warps` warps, the extra threads of the last block
// returning at once.
#include "ops/classifier.cuh"
#include "ops/elementwise.cuh"
#include "ops/flash.cuh"
#include "ops/fp8.cuh"
#include "ops/layernorm.cuh"
#include "ops/llama.cuh"
#include "ops/optim.cuh"
#include "ops/reduce.cuh"
#include "ops/softmax.cuh"

#define STOKER_ELEMENTS(name, params, n, call)                                                  \
  extern "C" __global__ void name params {                                                      \
    const int64_t grid_stride_ = int64_t(gridDim.x) * blockDim.x;                                     \
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); i += grid_stride_)      \
      call;                                                                                     \
  }

#define STOKER_PACKS(name, params, n, call)                                                     \
  extern "C" __global__ void name params {                                                      \
    const int64_t packs_ = ((n) + stoker::PACK - 1) / stoker::PACK;                             \
    const int64_t grid_stride_ = int64_t(gridDim.x) * blockDim.x;                               \
    for (int64_t p_ = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p_ < packs_;              \
         p_ += grid_stride_) {                                                                  \
      const int64_t i0 = p_ * stoker::PACK;                                                     \
      call;                                                                                     \
    }                                                                                           \
  }

#define STOKER_ROWS(name, params, rows, call)                                                   \
  extern "C" __global__ void name params {                                                      \
    const stoker::DeviceWarp w{int(threadIdx.x % stoker::WARP)};                                \
    const int64_t grid_stride_ = int64_t(gridDim.x) * blockDim.x / stoker::WARP;                      \
    for (int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / stoker::WARP;         \
         row < (rows); row += grid_stride_)                                                           \
      call;                                                                                     \
  }

#define STOKER_WARPS(name, params, warps, call)                                                 \
  extern "C" __global__ void name params {                                                      \
    const stoker::DeviceWarp w{int(threadIdx.x % stoker::WARP)};                                \
    const int wid = int((int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / stoker::WARP);       \
    if (wid < (warps)) call;                                                                    \
  }

#include "kernels.inc"
