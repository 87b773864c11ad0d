// Whether the AMX tile kernels can run on this machine (checked once at run time, never assumed).
#pragma once

namespace pagellm::cpu::amx {
// Whether torch.ops.pagellm.linear_amx can run: built with AMX-BF16, the CPU has it (CPUID), and the OS
// granted the tile state (Linux arch_prctl). Checked once; defined in linear_cpu.cpp.
bool amx_bf16_usable();
}  // namespace pagellm::cpu::amx
