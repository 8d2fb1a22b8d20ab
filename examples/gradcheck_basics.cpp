// gradcheck_basics — checking your own derivatives with troll's gradient checker.
//
// The function: a linear layer followed by softmax cross-entropy,
//   z = W a + b   (W: K x D, b: K, a fixed input of length D),
//   loss(W, b) = logsumexp(z) − z_label,
// with the parameters θ = (W row-major, then b) flattened into one vector of n = K*D + K doubles.
// Its gradient is ∂loss/∂z = softmax(z) − e_label, so ∂loss/∂W = (p − e_label) aᵀ, ∂loss/∂b = p −
// e_label.
//
// The program checks (1) that gradient against central differences, (2) the VJP of the vector
// function θ ↦ log_softmax(z) along random directions, and (3) shows the report of a deliberately
// wrong gradient. It exits 0 when the correct derivatives pass and the wrong one is caught.
//
// Build: g++ -std=c++17 -I include examples/gradcheck_basics.cpp -o gradcheck_basics

#include <troll/gradcheck.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <vector>

namespace {

constexpr std::size_t classes = 4;   // K
constexpr std::size_t features = 3;  // D
constexpr std::size_t parameters = classes * features + classes;
constexpr std::size_t label = 1;
const double input[features] = {0.5, -1.5, 2.0};  // a

// z = W a + b, read from the flat parameter vector θ.
void logits(const double* theta, double* z) {
  const double* weights = theta;
  const double* bias = theta + classes * features;
  for (std::size_t k = 0; k < classes; ++k) {
    z[k] = bias[k];
    for (std::size_t d = 0; d < features; ++d) z[k] += weights[k * features + d] * input[d];
  }
}

// log_softmax(z), stable form.
void log_probabilities(const double* theta, double* log_p) {
  double z[classes];
  logits(theta, z);
  const double largest = *std::max_element(z, z + classes);
  double sum = 0;
  for (double value : z) sum += std::exp(value - largest);
  const double log_normaliser = largest + std::log(sum);
  for (std::size_t k = 0; k < classes; ++k) log_p[k] = z[k] - log_normaliser;
}

double cross_entropy(const double* theta) {
  double log_p[classes];
  log_probabilities(theta, log_p);
  return -log_p[label];
}

// Back-propagates a cotangent on z to θ: ∂/∂W = g_z aᵀ, ∂/∂b = g_z.
void logits_vjp(const double* g_z, double* g_theta) {
  for (std::size_t k = 0; k < classes; ++k) {
    for (std::size_t d = 0; d < features; ++d) g_theta[k * features + d] = g_z[k] * input[d];
    g_theta[classes * features + k] = g_z[k];
  }
}

void cross_entropy_gradient(const double* theta, double* g_theta) {
  double log_p[classes], g_z[classes];
  log_probabilities(theta, log_p);
  for (std::size_t k = 0; k < classes; ++k) g_z[k] = std::exp(log_p[k]) - (k == label ? 1.0 : 0.0);
  logits_vjp(g_z, g_theta);
}

// VJP of θ ↦ log_softmax(z): g_z = g − p Σ g, then through the linear layer.
void log_probabilities_vjp(const double* theta, const double* g_log_p, double* g_theta) {
  double log_p[classes], g_z[classes];
  log_probabilities(theta, log_p);
  double total = 0;
  for (std::size_t k = 0; k < classes; ++k) total += g_log_p[k];
  for (std::size_t k = 0; k < classes; ++k) g_z[k] = g_log_p[k] - std::exp(log_p[k]) * total;
  logits_vjp(g_z, g_theta);
}

// A typical slip: the bias gradient forgets the −e_label term.
void wrong_gradient(const double* theta, double* g_theta) {
  cross_entropy_gradient(theta, g_theta);
  g_theta[classes * features + label] += 1.0;
}

}  // namespace

int main() {
  std::vector<double> theta(parameters);
  for (std::size_t k = 0; k < parameters; ++k)
    theta[k] = 0.3 * std::sin(1.7 * static_cast<double>(k) + 0.4);

  const troll::gradcheck_result gradient =
      troll::check_gradient(cross_entropy, cross_entropy_gradient, theta);
  std::printf("%s\n", gradient.report().c_str());

  troll::gradcheck_options options;
  options.directions = 32;
  const troll::gradcheck_result vjp =
      troll::check_vjp_random(log_probabilities, log_probabilities_vjp, theta, classes, options);
  std::printf("%s\n", vjp.report().c_str());

  std::printf("A deliberately wrong gradient, to show what a failure looks like:\n");
  const troll::gradcheck_result wrong = troll::check_gradient(cross_entropy, wrong_gradient, theta);
  std::printf("%s\n", wrong.report().c_str());

  const bool caught = !wrong.ok && wrong.worst_input == classes * features + label;
  if (gradient.ok && vjp.ok && caught) {
    std::printf("gradcheck_basics: all checks behaved as expected\n");
    return 0;
  }
  std::printf("gradcheck_basics: UNEXPECTED result\n");
  return 1;
}
