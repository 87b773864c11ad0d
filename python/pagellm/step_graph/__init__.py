"""Capture a step of the model's own forward once per shape and replay it from C++.

The CPU analogue of CUDA graphs: no second definition of the model, no per-model C++. See
`recorder.py` (what is recorded, what is refused) and `graph_cache.py` (when graphs are captured).
"""

from pagellm.step_graph.graph_cache import StepGraphCache, StepGraphMismatch, build_step_graph
from pagellm.step_graph.recorder import CaptureError, StepRecorder, iter_tensors

__all__ = ["CaptureError", "StepGraphCache", "StepGraphMismatch", "StepRecorder", "build_step_graph", "iter_tensors"]
