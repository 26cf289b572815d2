// CUDA backend. Every pointer in the params is device memory (cu_seqlens and kl_grad too).
// Calls only enqueue work on `stream`: no host synchronisation (check_indices, for indices from
// outside, is the one exception), no allocation, so a training step is CUDA-graph capturable. Scratch memory comes from the caller as a workspace whose
// size depends on the shapes alone (query it with the *_workspace_bytes functions).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "flash_msa/msa.h"

struct CUstream_st;
using cudaStream_t = CUstream_st*;

namespace flash_msa::cuda {

struct Workspace {
  void* data = nullptr;  // device memory, 256-byte aligned
  size_t bytes = 0;
};

// The select's workspace: the FP8 select's quantised copies and, for short sequences on the
// Hopper kernel (too few query tiles to fill the GPU), the top-K lists of the key walks it cuts
// into parts; 0 bytes otherwise.
size_t select_workspace_bytes(const SelectParams& params);
void select(const SelectParams& params, Workspace workspace, cudaStream_t stream);

// Sparse mode works through the sequence in token chunks whose partial results fit the
// workspace it is given: *_workspace_bytes(params, false) sizes one chunk of the whole sequence
// or, for long sequences, what the smallest chunk needs (index, accumulators and per-bucket
// buffers over the whole sequence) plus 8 GiB of per-token partial buffers;
// max_chunk_tokens > 0 sizes chunks of at most that many tokens per batch row instead (rounded
// down to a multiple of 128, at least 128), trading speed for memory. Results do not depend on
// the chunking, except the order of the fp32 sums of dk, dv, dkp over chunks.
// On the Hopper kernels with Dp = 128 and without the KL value (params.kl null), the sparse
// forward runs the query tiles of 128 positions whose queries all selected the same blocks
// query-outer (docs/design.md, the tile path); a forward with the value runs every query
// key-outer, so its out and lse equal those of one without it up to rounding.
size_t forward_workspace_bytes(const ForwardParams& params, bool warmup,
                               int64_t max_chunk_tokens = 0);
void sparse_forward(const ForwardParams& params, Workspace workspace, cudaStream_t stream);
void warmup_forward(const ForwardParams& params, Workspace workspace, cudaStream_t stream);

size_t backward_workspace_bytes(const BackwardParams& params, bool warmup,
                                int64_t max_chunk_tokens = 0);
void sparse_backward(const BackwardParams& params, Workspace workspace, cudaStream_t stream);
void warmup_backward(const BackwardParams& params, Workspace workspace, cudaStream_t stream);

// Checks block indices made outside the library (params.indices and the cu_seqlens values on
// the device) by the CPU backend's rule, validate_indices_values: one kernel finds the first row
// (in b, p, i order) that breaks it, then the call synchronises `stream` and throws
// flash_msa::Error in the CPU backend's words. The one call of this backend that waits for the
// device: select's indices are valid by construction and never need it. Workspace:
// check_indices_workspace_bytes().
size_t check_indices_workspace_bytes();
void check_indices(const CheckIndicesParams& params, Workspace workspace, cudaStream_t stream);

// True when a CUDA device of compute capability >= 8.0 is visible to this process.
bool device_available();

// The implementation of a stage's kernels.
enum class Kernels : int32_t {
  kPortable = 0,  // mma.sync tensor-core kernels, compute capability 8.0 and newer
  kHopper = 1,    // wgmma kernels for compute capability 9.x (H100, H200)
};
const char* kernels_name(Kernels kernels);  // "portable" or "hopper"

// What a call runs is chosen once per call, by one function per stage, from the chip, the
// problem and the call's options (src/cuda/host/variants.cu); the entry points follow that
// choice, and explain() reports it before a call, with the reason of each part.
struct Chip {
  int compute_major = 0;         // the device's compute capability major; 0: no CUDA device
  bool hopper_code = false;      // the binary holds sm_90a code for every Hopper kernel
  bool portable_forced = false;  // FLASH_MSA_PORTABLE_KERNELS set to anything but "0"
};
// The current device's (its properties probed once per device and cached; the environment
// variable read per call). No synchronisation.
Chip current_chip();

struct CallOptions {
  bool warmup = false;               // warmup_forward / warmup_backward, else select + sparse
  bool kl_value_in_forward = false;  // ForwardParams::kl set (the value from the forward)
  bool fp8_select = false;           // SelectParams::precision float8_e4m3
};
struct StageChoice {
  std::string stage;    // e.g. "select", "sparse_forward", "forward_tile_path"
  std::string variant;  // e.g. "hopper", "portable", "on", "off"
  std::string reason;   // why, in words: the chip, the shapes or the option that decided
};
// The parts of the call that `problem` and `options` describe, in the order they run, as the
// entry points will run them on `chip`. Throws flash_msa::Error where the call would (an FP8
// select the chip cannot run, say); the problem's limits are not checked here.
std::vector<StageChoice> explain(const Problem& problem, const CallOptions& options,
                                 const Chip& chip);
std::vector<StageChoice> explain(const Problem& problem, const CallOptions& options);

// The implementation sparse_forward and sparse_backward take for `problem` on the current
// chip: kHopper on compute capability 9.x when D = 128 and the binary holds sm_90a code,
// unless FLASH_MSA_PORTABLE_KERNELS is set to anything but "0"; kPortable otherwise.
Kernels sparse_kernels(const Problem& problem);
// The implementation warmup_forward and warmup_backward take: kHopper on compute capability 9.x
// when D = Dp = 128, under the same conditions otherwise (sm_90a code,
// FLASH_MSA_PORTABLE_KERNELS); kPortable otherwise. The Hopper kernels take G up to 64, the
// portable ones up to 16; a warmup forward asked for the KL value (params.kl) also runs the
// portable forward, whose second walk computes it, so it needs G <= 16 (the backward's value,
// kl of BackwardParams, has no such limit).
Kernels warmup_kernels(const Problem& problem);
// The implementation select takes: kHopper on compute capability 9.x when Dp is 64 or 128,
// under the same conditions otherwise (sm_90a code, FLASH_MSA_PORTABLE_KERNELS); kPortable
// otherwise.
Kernels select_kernels(const Problem& problem);

}  // namespace flash_msa::cuda
