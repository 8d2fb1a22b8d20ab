// make_batch over Eigen objects (troll/eigen.hpp): row-major matrices, maps with and without
// padding, blocks and Ref give the right pointer, shape and stride, const where the object is;
// column-major or non-contiguous rows throw shape_error. A projection through such views matches
// the one through raw pointers.
#include <doctest/doctest.h>

#include <type_traits>
#include <vector>

#include <troll/eigen.hpp>
#include <troll/projection.hpp>

using row_major = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

TEST_CASE("make_batch of row-major Eigen matrices, maps, blocks and Refs") {
  row_major z(3, 5);
  z.setRandom();
  const auto v = troll::make_batch(z);
  static_assert(std::is_same<decltype(v), const troll::batch_view<double>>::value, "mutable matrix, mutable view");
  CHECK(v.data == z.data());
  CHECK(v.rows == 3);
  CHECK(v.cols == 5);
  CHECK(v.stride == 5);

  const row_major& cz = z;
  static_assert(std::is_same<decltype(troll::make_batch(cz)), troll::batch_view<const double>>::value,
                "const matrix, const view");

  std::vector<float> padded(4 * 7, 0.0f);
  Eigen::Map<Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>, 0, Eigen::OuterStride<>> map(
      padded.data(), 4, 6, Eigen::OuterStride<>(7));
  const auto m = troll::make_batch(map);
  CHECK(m.data == padded.data());
  CHECK(m.rows == 4);
  CHECK(m.cols == 6);
  CHECK(m.stride == 7);

  Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>> cmap(padded.data(), 2, 14);
  static_assert(std::is_same<decltype(troll::make_batch(cmap)), troll::batch_view<const float>>::value,
                "a map of const data gives a const view");
  CHECK(troll::make_batch(cmap).stride == 14);

  const auto block = troll::make_batch(z.block(1, 1, 2, 3));
  CHECK(block.data == &z(1, 1));
  CHECK(block.stride == 5);
  CHECK(block.cols == 3);

  Eigen::Ref<row_major> ref(z);
  CHECK(troll::make_batch(ref).data == z.data());

  Eigen::VectorXd column(4);
  const auto c = troll::make_batch(column);
  CHECK(c.rows == 4);
  CHECK(c.cols == 1);
  CHECK(c.stride == 1);
}

TEST_CASE("make_batch refuses column-major matrices and non-contiguous rows with shape_error") {
  Eigen::MatrixXd col_major(3, 4);
  CHECK_THROWS_AS(troll::make_batch(col_major), troll::shape_error);
  CHECK_THROWS_WITH(troll::make_batch(col_major),
                    "troll::make_batch: the Eigen object is column-major (3x4); troll batches are row-major: use "
                    "Eigen::RowMajor");
  std::vector<double> data(24);
  Eigen::Map<row_major, 0, Eigen::Stride<Eigen::Dynamic, 2>> strided(data.data(), 3, 4, Eigen::Stride<Eigen::Dynamic, 2>(8, 2));
  CHECK_THROWS_AS(troll::make_batch(strided), troll::shape_error);
}

TEST_CASE("a projection through Eigen views equals the one through raw pointers") {
  row_major zn(4, 9), zo(4, 9), out(4, 9);
  zn.setRandom();
  zo.setRandom();
  zn *= 3.0;
  std::vector<double> raw(4 * 9);
  std::vector<troll::projection_stats> s1(4), s2(4);
  troll::project(troll::cpu, troll::make_batch(zn), troll::make_batch(zo), 0.05, troll::make_batch(out), s1.data());
  troll::project(troll::cpu, troll::make_batch(zn.data(), 4, 9), troll::make_batch(zo.data(), 4, 9), 0.05,
                 troll::make_batch(raw.data(), 4, 9), s2.data());
  for (std::size_t i = 0; i < raw.size(); ++i) CHECK(out.data()[i] == raw[i]);
}
