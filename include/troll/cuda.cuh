// troll/cuda.cuh — the CUDA backend (nvcc only): every entry point of the CPU API that the device
// runs, with the CPU's argument lists, under the troll::cuda policy:
//
//   troll::project(troll::cuda.on(stream), new_logits, old_logits, eps, out_log_probs, stats);
//   troll::project(troll::cuda.on(stream).checked(), ...);   // throw the CPU's exceptions
//
// Every pointer is device memory; work is enqueued on policy.stream; by default nothing allocates
// and nothing synchronises. The five headers below are independent (none includes another).
#pragma once

#include "cuda_dense.cuh"              // log_softmax, kl, kl_backward, project and its derivatives
#include "cuda_gaussian.cuh"           // gaussian::project_joint / project_split / *_diag
#include "cuda_objectives.cuh"         // TROLL, PPO clip and DPPO objectives
#include "cuda_sparse.cuh"             // sparsify, shards, align, sparse kl / project / backward
#include "cuda_sparse_objectives.cuh"  // TROLL on sparse old rows
