"""Refuse a device the engine cannot run on, before anything is loaded: a clear ValueError naming why
(CPU-only torch, no visible GPU, a GPU index past the count, a pagellm build without CUDA kernels), not an
assertion deep inside torch or a kernel; and a model too large for the GPU: a ValueError with the numbers."""

from __future__ import annotations

import torch


def check_device_usable(device: torch.device) -> None:
    device = torch.device(device)
    if device.type != "cuda":
        return
    if torch.version.cuda is None:
        raise ValueError(f"device={str(device)!r} needs a CUDA build of PyTorch; this torch {torch.__version__} is "
                         "CPU-only (use device='cpu', or install a CUDA torch and rebuild pagellm)")
    if not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} but no CUDA GPU is visible (torch.cuda.is_available() is False: "
                         "no driver, or CUDA_VISIBLE_DEVICES hides them)")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(f"device={str(device)!r} but only {count} CUDA device(s) are visible")
    from pagellm import _C  # noqa: PLC0415 (only for CUDA devices)

    if not _C.built_with_cuda:
        raise ValueError(f"device={str(device)!r} but pagellm._C was built without CUDA kernels (torch without "
                         "CUDA or no nvcc at build time): rebuild pagellm where both are present (tools/gpu/build.sh)")


GiB = 1 << 30


def weights_do_not_fit(device: torch.device, dtype: torch.dtype, err: BaseException) -> ValueError:
    """The error for a model whose weights ran out of GPU memory while loading (torch.OutOfMemoryError `err`):
    the GPU's free / total memory now and what torch could not allocate."""
    device = torch.device(device)
    free, total = torch.cuda.mem_get_info(device)
    return ValueError(f"the model's weights do not fit {device}: loading them in {dtype} ran out of memory with "
                      f"{free / GiB:.2f} GiB of {total / GiB:.2f} GiB free ({str(err).splitlines()[0]}). Use a "
                      "smaller dtype or a quantized checkpoint, free the GPU, or use another device.")
