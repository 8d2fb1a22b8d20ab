// troll/cuda_report.hpp — how the CUDA backend tells the caller about a rejected input row: the
// per-row report word (cuda_row_error, cuda_row_report) and the validation controls a cuda_policy
// carries (cuda_checks). Host-only declarations: no CUDA headers are needed to name them.
#pragma once

#include "config.hpp"
#include "row_error.hpp"

TROLL_BEGIN_NAMESPACE

/// The CUDA reports' name for the row codes (troll/row_error.hpp): one code set for both
/// backends.
using cuda_row_error = row_error;

/// One row's validation outcome, written by every CUDA entry point that is given a report array.
/// `operand` indexes the entry point's arguments: 0 the first logits argument (logits, p_logits
/// or new_logits), 1 the second (q_logits or old_logits), 2 the upstream gradient. For bad_stats
/// it names the field instead: 0 t, 1 sigma2, 2 mu, 3 status (the status in `value`), 4 kl_after.
struct cuda_row_report {
  cuda_row_error error = cuda_row_error::none;
  int operand = 0;
  unsigned long long token = 0;
  double value = 0.0;
};

/// Device-side validation controls, carried by the policy (troll::cuda.on(s).checked(),
/// .reporting(reports, first_bad_row) or .with_checks(checks)).
///
/// * Default (all null, checked = false): rows are validated inside the kernels at no extra
///   pass; a rejected row gets NaN outputs (and projection_stats with NaN fields and status
///   infeasible) and nothing tells the host. Nothing synchronises.
/// * `reports`: device array of `rows` reports, one written per row (error none when the row is
///   fine). `first_bad_row`: one device word, reset with cudaMemsetAsync and lowered with
///   atomicMin to the lowest rejected row (all ones when none). Both are stream-ordered; the
///   caller reads them whenever it synchronises anyway.
/// * `checked = true`: a validation kernel runs first, the stream is synchronised and the first
///   rejected row is thrown as the CPU backend's typed exception, naming the row, before any
///   output is written (the same class, message and row_error code). The validation writes
///   every row's report to stream-ordered scratch (cudaMallocAsync, a report per row) and finds
///   the lowest rejected row with one atomicMin: one validation pass and one synchronisation,
///   meant for debugging and tests, not for the training hot path.
struct cuda_checks {
  cuda_row_report* reports = nullptr;
  unsigned long long* first_bad_row = nullptr;
  bool checked = false;
};

/// `troll::cuda_checked`: the synchronising, throwing mode.
inline constexpr cuda_checks cuda_checked{nullptr, nullptr, true};

TROLL_END_NAMESPACE
