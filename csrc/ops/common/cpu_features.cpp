#include "ops/common/cpu_features.h"

#include <cpuid.h>

#include <cstdint>

namespace pagellm::cpu {
namespace {

struct CpuidRegs {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
};

CpuidRegs cpuid(unsigned leaf, unsigned subleaf) {
  CpuidRegs r;
  if (!__get_cpuid_count(leaf, subleaf, &r.eax, &r.ebx, &r.ecx, &r.edx)) return CpuidRegs{};
  return r;
}

bool bit(unsigned reg, int i) { return (reg >> i) & 1u; }

// XCR0: the register state the OS saves on a context switch (inline asm: the intrinsic needs -mxsave).
uint64_t xcr0() {
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

}  // namespace

std::vector<std::string> cpu_features() {
  std::vector<std::string> out;
  const CpuidRegs l1 = cpuid(1, 0);
  if (!bit(l1.ecx, 27)) return out;  // no OSXSAVE: the OS saves no AVX state, XGETBV is not allowed
  const uint64_t state = xcr0();
  const bool ymm = (state & 0x6) == 0x6;                    // SSE + AVX halves
  const bool zmm = ymm && (state & 0xe0) == 0xe0;           // opmask, ZMM_Hi256, Hi16_ZMM
  const bool tiles = (state & 0x60000) == 0x60000;          // XTILECFG + XTILEDATA
  const CpuidRegs l7 = cpuid(7, 0), l7s1 = cpuid(7, 1), ext = cpuid(0x80000001, 0);
  auto add = [&out](bool present, const char* name) {
    if (present) out.emplace_back(name);
  };
  add(ymm && bit(l1.ecx, 28), "avx");
  add(ymm && bit(l7.ebx, 5), "avx2");
  add(bit(l7.ebx, 3), "bmi1");
  add(bit(l7.ebx, 8), "bmi2");
  add(ymm && bit(l1.ecx, 29), "f16c");
  add(ymm && bit(l1.ecx, 12), "fma");
  add(bit(ext.ecx, 5), "lzcnt");
  add(bit(l1.ecx, 22), "movbe");
  add(zmm && bit(l7.ebx, 16), "avx512f");
  add(zmm && bit(l7.ebx, 30), "avx512bw");
  add(zmm && bit(l7.ebx, 28), "avx512cd");
  add(zmm && bit(l7.ebx, 17), "avx512dq");
  add(zmm && bit(l7.ebx, 31), "avx512vl");
  add(zmm && bit(l7.ecx, 11), "avx512_vnni");
  add(zmm && bit(l7s1.eax, 5), "avx512_bf16");
  add(tiles && bit(l7.edx, 24), "amx_tile");
  add(tiles && bit(l7.edx, 22), "amx_bf16");
  return out;
}

}  // namespace pagellm::cpu
