// Build (from the repo root, after make install):
//   T=.venv/lib/python3.11/site-packages/torch; g++ -O3 -DNDEBUG -march=x86-64-v4 -mavx512bf16 -mavx512vnni \
//     -ffp-contract=off -std=gnu++17 -fopenmp -I csrc -isystem $T/include benchmarks/decode_attention_harness.cpp \
//     -o /tmp/harness -L build/cp311-cp311-linux_x86_64 -l:_C_cpu_common.so -L $T/lib -ltorch_cpu -lc10 \
//     -Wl,-rpath,$PWD/build/cp311-cp311-linux_x86_64:$PWD/$T/lib   (-march=x86-64-v3 for the avx2 form)
// Run: /tmp/harness CONTEXT [QUERIES=1] [COLD=0] [GROUP=3]; THREADS=n sizes the pool (default 1).
// Standalone timing of the CPU decode kernel (one thread unless POOL env), no Python / dispatcher.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#include <algorithm>
#include <ctime>
#include "ops/paged_attention/decode_runs_cpu_kernels.h"
using namespace pagellm::cpu;
using bf = c10::BFloat16;
static double tnow() { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char** argv) {
  int ctx = atoi(argv[1]), Q = argc > 2 ? atoi(argv[2]) : 1; int cold = argc > 3 ? atoi(argv[3]) : 0;
  int G = argc > 4 ? atoi(argv[4]) : 3;
  const int64_t H = 3, D = 64, BS = 16, heads = H * G;
  pagellm::ThreadPoolSettings st; st.num_threads = getenv("THREADS") ? atoi(getenv("THREADS")) : 1; pagellm::configure_thread_pool(st);
  int64_t blocks = (ctx + Q + BS) / BS + 1;
  int64_t layer_bytes = blocks * H * BS * D * 2 * 2;
  int nl = cold ? std::max<int64_t>(30, 64e6 / layer_bytes) : 1;
  std::mt19937 rng(1); std::normal_distribution<float> nd;
  std::vector<std::vector<bf>> kc(nl), vc(nl);
  for (int l = 0; l < nl; ++l) { kc[l].resize(blocks * H * BS * D); vc[l].resize(kc[l].size());
    for (auto& x : kc[l]) x = bf(nd(rng)); for (auto& x : vc[l]) x = bf(nd(rng)); }
  std::vector<int32_t> perm(blocks); for (int i = 0; i < blocks; ++i) perm[i] = i; std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> bt(Q * blocks), lens(Q);
  for (int q = 0; q < Q; ++q) { std::copy(perm.begin(), perm.end(), bt.begin() + q * blocks); lens[q] = ctx + q; }
  std::vector<bf> qv(Q * heads * D), out(Q * heads * D);
  for (auto& x : qv) x = bf(nd(rng));
  PagedAttnArgs<bf, bf> a{out.data(), qv.data(), nullptr, nullptr, bt.data(), lens.data(), nullptr, blocks, Q, heads, H, D, BS, 4,
                          heads * D, D, heads * D, D, H * BS * D, BS * D, 0.125f, -1, 0.f};
  int reps = std::max(1, 20000 / nl);
  std::vector<double> ts;
  for (int r = 0; r < 9; ++r) {
    double t = tnow();
    for (int i = 0; i < reps; ++i) for (int l = 0; l < nl; ++l) {
      a.key_cache = kc[l].data(); a.value_cache = vc[l].data();
      paged_attention_decode_runs_kernel(a);
    }
    ts.push_back((tnow() - t) / (reps * nl) * 1e6);
  }
  std::sort(ts.begin(), ts.end());
  double cs = 0; for (auto x : out) cs += float(x);
  printf("ctx %5d Q %2d G %d %s: %7.2f us/call (min %.2f) checksum %.6f\n", ctx, Q, G, cold ? "cold" : "warm", ts[4], ts[0], cs);
}
