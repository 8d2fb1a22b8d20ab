// troll/sparse_objective_types.hpp — what the CPU (troll/sparse_objectives.hpp) and CUDA
// (troll/cuda_sparse_objectives.cuh) overloads of TROLL's sparse objective share: the objective's
// parameters, the host-side argument checks that read no values, and the messages of the row
// problems that are particular to sparse old rows. Eigen-free.
#pragma once

#include <cstddef>
#include <string>

#include "batch.hpp"
#include "config.hpp"
#include "detail/numeric.hpp"
#include "detail/objective_arguments.hpp"
#include "detail/sparse_arguments.hpp"
#include "errors.hpp"
#include "objective_types.hpp"
#include "projection_types.hpp"
#include "sparse_types.hpp"
#include "detail/number_text.hpp"

TROLL_BEGIN_NAMESPACE

/// TROLL's objective on sparse rows: ε, α and the projection options as in
/// trust_region_objective, plus how the new row's own support joins U. The union is
///   U = S_new ∪ S_old,  S_new = the sparsify prefix of the new logits (at most new_support.k
///   tokens, mass ≥ 1 − new_support.delta; k = 0: S_new = ∅ and U = S_old),
/// so mass the new policy moved onto tokens outside the old support is seen exactly instead of
/// being lumped into the bucket. S_new is piecewise constant in the logits: no gradient flows
/// through the choice of support, only through the gathered values.
struct sparse_trust_region_objective {
  double eps = 0.05;
  double alpha = 1.0;
  projection_options projection{};
  sparsify_options new_support{};  ///< k = 64, δ = 1e-5; k may be 0 here
};

namespace detail {

inline trust_region_objective dense_part(const sparse_trust_region_objective& o) {
  trust_region_objective d;
  d.eps = o.eps;
  d.alpha = o.alpha;
  d.projection = o.projection;
  return d;
}

inline void check_sparse_objective(const char* fn, const sparse_trust_region_objective& o) {
  check_trust_region(fn, dense_part(o));
  if (o.new_support.k != 0) {
    check_sparsify_options(fn, o.new_support);
  } else if (!(o.new_support.delta >= 0.0 && o.new_support.delta < 1.0)) {
    throw domain_error(std::string("troll::") + fn + ": new_support.delta must be in [0, 1), got " +
                       detail::number_text(o.new_support.delta));
  }
}

/// The token batch's pointers every sparse objective call needs when rows > 0.
template <class T>
void check_sparse_token_batch(const char* fn, const token_batch<T>& in, const void* stats) {
  check_aggregation(fn, in.aggregation);
  if (in.tokens == nullptr) throw_shape(fn, "tokens is a null pointer");
  if (in.advantages == nullptr) throw_shape(fn, "advantages is a null pointer");
  if (in.aggregation == loss_aggregation::sequence_mean && in.sequence_ids == nullptr)
    throw_shape(fn, "sequence_mean aggregation needs sequence_ids (a null pointer was given)");
  if (stats == nullptr) throw_shape(fn, "stats is a null pointer");
}

/// The host-side checks of the sparse objective's forward that read no values (every backend):
/// the objective, the views, their rows and vocabularies, the token batch's pointers and stats.
template <class T>
void check_sparse_forward_arguments(const char* fn, const sparse_trust_region_objective& objective,
                                    const batch_view<const T>& new_logits,
                                    const sparse_batch_view<const T>& old_rows,
                                    const token_batch<T>& in, const aligned_batch_view<T>& aligned,
                                    const sparse_batch_view<T>& log_probs,
                                    const projection_stats* stats) {
  check_sparse_objective(fn, objective);
  check_view(fn, "new_logits", new_logits);
  check_sparse_view(fn, "old", old_rows);
  check_aligned_view(fn, "aligned", aligned);
  check_sparse_view(fn, "log_probs", log_probs);
  const std::size_t rows = new_logits.rows, vocab = new_logits.cols;
  check_same_rows(fn, "new_logits", rows, "old", old_rows.rows);
  check_same_rows(fn, "new_logits", rows, "aligned", aligned.rows);
  check_same_rows(fn, "new_logits", rows, "log_probs", log_probs.rows);
  if (rows == 0) return;
  check_same_vocab(fn, "new_logits", vocab, "old", old_rows.vocab);
  check_same_vocab(fn, "new_logits", vocab, "aligned", aligned.vocab);
  check_same_vocab(fn, "new_logits", vocab, "log_probs", log_probs.vocab);
  check_sparse_token_batch(fn, in, stats);
}

/// The host-side checks of the sparse objective's backward that read no values (every backend),
/// grad_loss included.
template <class T>
void check_sparse_backward_arguments(const char* fn, const sparse_trust_region_objective& objective,
                                     const batch_view<const T>& new_logits,
                                     const aligned_batch_view<const T>& aligned,
                                     const token_batch<T>& in,
                                     const sparse_batch_view<const T>& log_probs,
                                     const projection_stats* stats, const batch_view<T>& grad_new,
                                     double grad_loss) {
  check_sparse_objective(fn, objective);
  check_view(fn, "new_logits", new_logits);
  check_view(fn, "grad_new", grad_new);
  check_same_shape(fn, "new_logits", new_logits, "grad_new", grad_new);
  check_aligned_view(fn, "aligned", aligned);
  check_sparse_view(fn, "log_probs", log_probs);
  const std::size_t rows = new_logits.rows, vocab = new_logits.cols;
  check_same_rows(fn, "new_logits", rows, "aligned", aligned.rows);
  check_same_rows(fn, "new_logits", rows, "log_probs", log_probs.rows);
  if (rows != 0) {
    check_same_vocab(fn, "new_logits", vocab, "aligned", aligned.vocab);
    check_same_vocab(fn, "new_logits", vocab, "log_probs", log_probs.vocab);
    check_sparse_token_batch(fn, in, stats);
  }
  if (!(grad_loss - grad_loss == 0.0))
    throw domain_error(std::string("troll::") + fn + ": grad_loss is not finite");
}

}  // namespace detail

TROLL_END_NAMESPACE
