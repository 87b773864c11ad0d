// Writes the CPU decode kernel's outputs over 600 random configs (GQA 1-16, D 64/80/128, blocks 1-64, contexts
// 0-2000, windows, soft-capping, runs of 1-16 queries, bf16 and fp32) to a file: build it (as
// decode_attention_harness.cpp says) against two versions of csrc/ and cmp the files to check a change keeps
// every bit. Run: /tmp/bits OUT_FILE THREADS.
// Dumps the decode kernel's outputs over many random configs (bits compared between builds).
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#include <algorithm>
#include "ops/paged_attention/decode_runs_cpu_kernels.h"
using namespace pagellm::cpu;
using bf = c10::BFloat16;
template <typename T>
void run(FILE* f, std::mt19937& rng, int cfg) {
  std::uniform_int_distribution<int> U(0, 1 << 30);
  std::normal_distribution<float> nd;
  const int Gs[] = {1, 3, 4, 8, 6, 16};
  const int64_t G = Gs[U(rng) % 6], H = 1 + U(rng) % 3, D = (U(rng) % 2) ? 64 : (U(rng) % 2 ? 128 : 80);
  const int64_t BS = int64_t{1} << (U(rng) % 7);
  const int Q = (cfg % 3 == 0) ? 1 + U(rng) % 16 : 1 + U(rng) % 3;
  const bool runs = cfg % 2 == 0;  // consecutive positions of one row
  const int64_t maxctx = (cfg % 5 == 0) ? 2000 : 300;
  const float softcap = (U(rng) % 4 == 0) ? 5.f : 0.f;
  const int64_t window = (U(rng) % 4 == 0) ? 1 + U(rng) % 200 : -1;
  const int64_t heads = G * H;
  std::vector<int32_t> lens(Q);
  int64_t base = 1 + U(rng) % maxctx;
  for (int q = 0; q < Q; ++q) lens[q] = runs ? base + q : 1 + U(rng) % maxctx;
  if (U(rng) % 7 == 0) lens[0] = 0;
  int64_t maxlen = *std::max_element(lens.begin(), lens.end());
  int64_t nbps = (maxlen + BS - 1) / BS + 1, blocks = nbps * Q + 1;
  std::vector<T> kc(blocks * H * BS * D), vc(kc.size());
  for (auto& x : kc) x = T(nd(rng)); for (auto& x : vc) x = T(nd(rng));
  std::vector<int32_t> perm(blocks); for (int i = 0; i < blocks; ++i) perm[i] = i; std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> bt(Q * nbps);
  for (int q = 0; q < Q; ++q) for (int b = 0; b < nbps; ++b) bt[q * nbps + b] = runs ? perm[b] : perm[(q * nbps + b) % blocks];
  std::vector<T> qv(Q * heads * D), out(Q * heads * D);
  for (auto& x : qv) x = T(nd(rng));
  int64_t l2 = 0; while ((int64_t{1} << l2) < BS) ++l2;
  PagedAttnArgs<T, T> a{out.data(), qv.data(), kc.data(), vc.data(), bt.data(), lens.data(), nullptr, nbps, Q, heads, H, D, BS, l2,
                        heads * D, D, heads * D, D, H * BS * D, BS * D, 1.0f / std::sqrt(float(D)), window, softcap};
  paged_attention_decode_runs_kernel(a);
  fwrite(out.data(), sizeof(T), out.size(), f);
}
int main(int argc, char** argv) {
  pagellm::ThreadPoolSettings st; st.num_threads = atoi(argv[2]); pagellm::configure_thread_pool(st);
  FILE* f = fopen(argv[1], "wb");
  std::mt19937 rng(7);
  for (int cfg = 0; cfg < 600; ++cfg) {
    if (cfg % 3 == 2) run<float>(f, rng, cfg); else run<bf>(f, rng, cfg);
  }
  fclose(f);
}
