"""Each bad-input call that crashed a pytest worker on the H200 (session 14), alone in a subprocess with
faulthandler: its exit code and the end of its stderr (a C++ terminate message or a native stack)."""

from __future__ import annotations

import subprocess
import sys

SETUP = """
import torch, pagellm
from pagellm import ops
OP = torch.ops.pagellm
d = "cuda"
"""
PROBES = {
    "control: arg_checks dtype refusal": """
q = torch.randn(2, 3, 576, device=d); c = torch.randn(4, 16, 576, device=d)
OP.paged_mla_decode(torch.zeros(2, 3, 512, device=d), q, c, torch.zeros(2, 2, dtype=torch.int64, device=d),
                    torch.tensor([3, 9], dtype=torch.int32, device=d), 0.2)
""",
    "mla: rank 0 (mla_checks.h)": """
q = torch.randn(2, 3, 576, device=d); c = torch.randn(4, 16, 576, device=d)
OP.paged_mla_decode(torch.zeros(2, 3, 0, device=d), q, c, torch.zeros(2, 2, dtype=torch.int32, device=d),
                    torch.tensor([3, 9], dtype=torch.int32, device=d), 0.2)
""",
    "prefill: head_dim 32 (glue TORCH_CHECK)": """
kc = torch.randn(8, 4, 4, 32, device=d, dtype=torch.bfloat16); vc = torch.randn_like(kc)
q = torch.randn(17, 4, 32, device=d, dtype=torch.bfloat16)
OP.paged_attention_prefill(torch.empty_like(q), q, kc, vc, torch.arange(8, dtype=torch.int32, device=d)[None],
    torch.tensor([0, 17], dtype=torch.int32, device=d), torch.tensor([17], dtype=torch.int32, device=d), 0.1, -1, 0.0)
""",
    "python: torch's own TORCH_CHECK": """
torch.zeros(2, 3, device=d) @ torch.zeros(4, 5, device=d)
""",
}
if len(sys.argv) > 1:  # `raise_probe.py N`: run probe N in this process (under cuda-gdb for a native stack)
    exec(SETUP + list(PROBES.values())[int(sys.argv[1])])
    sys.exit(0)
for name, body in PROBES.items():
    r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", SETUP + body], capture_output=True, text=True,
                       timeout=120)
    tail = "\n    ".join((r.stderr or "").strip().splitlines()[-12:])
    print(f"== {name}: exit {r.returncode}\n    {tail}", flush=True)
