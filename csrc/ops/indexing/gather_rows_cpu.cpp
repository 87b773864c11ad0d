// CPU gather_rows: out[i, :] = src[index[i], :] (the embedding lookup and the logits rows' hidden states).
// Why not index_select / index: above ATen's grain (32k elements) they open an OpenMP region, and on a loaded
// machine each waited milliseconds for a preempted OpenMP worker in every decode step (bench_batch_profile.py);
// here a step's few rows are copied on the calling thread, large gathers split over pagellm's pool.
#include <torch/library.h>

#include <cstring>

#include "ops/common/checks.h"
#include "ops/common/parallel.h"

namespace pagellm::cpu {
namespace {

template <typename I>
void check_index_range(const I* idx, int64_t n, int64_t rows) {
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(idx[i] >= 0 && idx[i] < rows, "index[", i, "] = ", static_cast<int64_t>(idx[i]),
                " is out of range for src with ", rows, " rows");
  }
}

template <typename I>
void copy_rows(char* out, const char* src, const I* idx, int64_t n, int64_t row_bytes, int64_t out_stride,
               int64_t src_stride) {
  // ~256 KiB per chunk: a decode step's rows stay on the calling thread.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(row_bytes, 1));
  pagellm::cpu::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) std::memcpy(out + i * out_stride, src + idx[i] * src_stride, row_bytes);
  });
}

void gather_rows(at::Tensor& out, const at::Tensor& src, const at::Tensor& index) {
  check_cpu(out, "out");
  check_cpu(src, "src");
  check_cpu(index, "index");
  check_dim(src, 2, "src");
  check_dim(out, 2, "out");
  check_dim(index, 1, "index");
  check_same_dtype(out, src, "out", "src");
  TORCH_CHECK(index.scalar_type() == at::kLong || index.scalar_type() == at::kInt,
              "index must have dtype int64 or int32, got ", index.scalar_type());
  const int64_t n = index.size(0), d = src.size(1);
  TORCH_CHECK(out.size(0) == n && out.size(1) == d, "out must have shape [", n, ", ", d, "], got ", out.sizes());
  if (n == 0 || d == 0) return;
  check_last_contiguous(out, "out");
  const at::Tensor s = src.stride(1) == 1 ? src : src.contiguous();
  const at::Tensor ix = index.contiguous();
  const int64_t es = static_cast<int64_t>(src.element_size());
  char* o = static_cast<char*>(out.data_ptr());
  const char* sp = static_cast<const char*>(s.data_ptr());
  if (ix.scalar_type() == at::kLong) {
    check_index_range(ix.data_ptr<int64_t>(), n, s.size(0));  // every index before any row is written
    copy_rows(o, sp, ix.data_ptr<int64_t>(), n, d * es, out.stride(0) * es, s.stride(0) * es);
  } else {
    check_index_range(ix.data_ptr<int32_t>(), n, s.size(0));
    copy_rows(o, sp, ix.data_ptr<int32_t>(), n, d * es, out.stride(0) * es, s.stride(0) * es);
  }
}

}  // namespace
}  // namespace pagellm::cpu

TORCH_LIBRARY_IMPL(pagellm, CPU, m) { m.impl("gather_rows", &pagellm::cpu::gather_rows); }
