// Every VecF function of ops/common/cpu_vec.h on fixed pseudo-random inputs, written as raw fp32 bits to
// argv[1]. tests/ops/test_isa_variants.py compiles this once per -march and compares the files byte for byte
// (the AVX2 backend must reproduce the AVX-512 one exactly). Not part of the extension build.
#include "ops/common/cpu_vec.h"
#include <cstdio>
#include <random>
#include <vector>
using namespace pagellm::cpu;
int main(int argc, char** argv) {
  if (argc != 2) return 2;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> out;
  auto put = [&](VecF v) { float b[16]; vstore(b, v); out.insert(out.end(), b, b + 16); };
  for (int it = 0; it < 20000; ++it) {
    float a[32], b[32], c[16];
    float sc = std::ldexp(1.f, (int)(rng() % 30) - 15);
    for (int i = 0; i < 32; ++i) { a[i] = nd(rng) * sc; b[i] = nd(rng) * 3; }
    for (int i = 0; i < 16; ++i) c[i] = nd(rng) * 100;
    if (it % 3 == 0) for (int i = 0; i < 16; ++i) a[i] = -std::fabs(a[i]) * 30;  // exp range incl. < -87
    VecF va = vload(a), vb = vload(b), vc = vload(c);
    put(vexp(va)); put(vexp_lowp(va)); put(vexp(vmul(vc, vset1(0.9f)))); put(vexp_lowp(vc));
    put(vtanh(va)); put(verf(vb)); put(vfma(va, vb, vc)); put(vdiv(va, vb)); put(vswap_pairs(va));
    put(vcopysign(va, vb)); put(vselect_lt(va, vb, vc, vb)); put(vabs(vb)); put(vmax(va, vb)); put(vmin(va,vb));
    out.push_back(vsum(va)); out.push_back(vmaxall(vb));
    VecF v16[16]; for (int i = 0; i < 16; ++i) v16[i] = vmul(va, vset1(nd(rng)));
    put(vsum16(v16));
    c10::BFloat16 hb[16]; c10::Half hh[16];
    int n = it % 17;
    for (int i = 0; i < 16; ++i) { hb[i] = c10::BFloat16(0.f); hh[i] = c10::Half(0.f); }
    vstore(hb, vmul(va, vb), n); vstore(hh, vmul(va, vb), n);
    put(vload(hb)); put(vload(hh)); put(vload(hb, n)); put(vload(hh, n)); put(vload(a, n));
    float st[16] = {0}; vstore(st, va, n); put(vload(st));
    put(vround<c10::BFloat16>(vc)); put(vround<c10::Half>(va));
    c10::BFloat16 x32[32], y32[32];
    for (int i = 0; i < 32; ++i) { x32[i] = c10::BFloat16(a[i]); y32[i] = c10::BFloat16(b[i]); }
#ifdef PAGELLM_BF16_DOT
    put(vdot_bf16(vc, bf16x32_load(x32), bf16x32_load(y32)));
    put(vdot_bf16(vc, bf16x32_load(x32, n + 5), bf16x32_load(y32, n + 5)));
    uint32_t pairs[16];
    vstore_bf16_pairs(pairs, va, vmul(vb, vset1(1e-3f)));
    put(vdot_bf16(vc, bf16x32_load(reinterpret_cast<const c10::BFloat16*>(pairs)), bf16x32_load(y32)));
    BF16x32 zlo, zhi;  // the decode P.V's zipped value rows: each half read back through both pair positions
    bf16x32_zip(bf16x32_load(x32), bf16x32_load(y32), zlo, zhi);
    for (const BF16x32& z : {zlo, zhi}) {
      put(vdot_bf16(vzero(), z, bf16x32_set1_pair(0x3f80u)));
      put(vdot_bf16(vzero(), z, bf16x32_set1_pair(0x3f800000u)));
      put(vdot_bf16(vc, z, bf16x32_set1_pair(pairs[n % 16])));
    }
#endif
  }
  FILE* f = fopen(argv[1], "wb"); fwrite(out.data(), 4, out.size(), f); fclose(f);
  printf("%zu floats\n", out.size());
}
