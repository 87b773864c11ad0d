"""pagellm: a readable LLM inference engine with a paged KV cache and a C++/CUDA core."""

import torch  # noqa: F401  (loads libtorch before the _C extension)

from pagellm.version import __version__

__all__ = ["__version__"]
