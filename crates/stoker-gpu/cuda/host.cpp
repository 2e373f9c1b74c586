// The host build of stoker's GPU kernels: each entry of kernels.inc as a C function,
// stoker_host_<name>, that runs the kernel's body over its whole grid on the CPU, lane by
// lane (warp.h's HostWarp). Compiled by build.rs with the system C++ compiler and
// -ffp-contract=off, so that its results are the device's bit for bit; the Rust tests
// check it against stoker-kernels' CPU twins, and the device check checks the GPU
// against it.
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
  extern "C" void stoker_host_##name params {                                                   \
    for (int64_t i = 0; i < (n); ++i) call;                                                     \
  }

// A pack kernel also gets stoker_host_range_<name>(lo, hi, params...): the packs that
// start in [lo, hi) alone (lo a multiple of PACK), so that the host can run a long grid
// in pieces on several threads. A pack writes only its own elements, as one GPU thread
// does, so the pieces give the whole grid's bits in any order.
#define STOKER_UNPAREN(...) __VA_ARGS__
#define STOKER_PACKS(name, params, n, call)                                                     \
  extern "C" void stoker_host_##name params {                                                   \
    for (int64_t i0 = 0; i0 < (n); i0 += stoker::PACK) call;                                    \
  }                                                                                             \
  extern "C" void stoker_host_range_##name(int64_t lo, int64_t hi, STOKER_UNPAREN params) {     \
    const int64_t end = (n) < hi ? (n) : hi;                                                    \
    for (int64_t i0 = lo; i0 < end; i0 += stoker::PACK) call;                                   \
  }

#define STOKER_ROWS(name, params, rows, call)                                                   \
  extern "C" void stoker_host_##name params {                                                   \
    const stoker::HostWarp w{};                                                                 \
    for (int64_t row = 0; row < (rows); ++row) call;                                            \
  }

#define STOKER_WARPS(name, params, warps, call)                                                 \
  extern "C" void stoker_host_##name params {                                                   \
    const stoker::HostWarp w{};                                                                 \
    for (int wid = 0; wid < (warps); ++wid) call;                                               \
  }

#include "kernels.inc"
