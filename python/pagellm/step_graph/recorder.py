"""Record a step of the model's own forward as the sequence of dispatcher calls it makes.

A `TorchDispatchMode` sees every aten and `torch.ops.pagellm` call that reaches the dispatcher, with
the real tensors (the step runs eagerly while it is recorded, so the recording step's result is the
eager result). Each call is kept as (operator, where each argument comes from, which value slots its
tensor outputs fill): a step input, an earlier call's output, or a constant. Constants are Python
values (sizes, dtypes, flags) and tensors the caller declared fixed (weights, buffers, KV caches).

What cannot be replayed is refused with `CaptureError` instead of being baked in silently: an op
returning a Python scalar (`.item()`, `int(t)`: data read into Python), or a tensor of unknown origin
(created outside the dispatcher, e.g. `torch.from_numpy` on step data).

Contract for a forward that is captured: with the same shapes, it makes the same calls; it reads
tensor data only through ops (never `.tolist()` / `.numpy()` into Python control flow).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


_DETACH = torch.ops.aten.detach.default


class CaptureError(RuntimeError):
    """The step cannot be recorded as a replayable sequence of calls (the reason says why)."""


@dataclass
class RecordedCall:
    name: str                                    # "aten::view", "pagellm::rms_norm"
    overload: str                                # "default", "memory_format", ...
    args: list[tuple]                            # one descriptor per schema argument (see csrc/bindings/py_graph.cpp)
    outputs: list[tuple[int, int, int]]          # (return index, list element or -1, slot)


@dataclass
class Recording:
    num_inputs: int
    calls: list[RecordedCall] = field(default_factory=list)
    output_slots: list[int] = field(default_factory=list)


def _is_tensor_list_type(t) -> bool:
    if not isinstance(t, torch.ListType):
        return False
    elem = t.getElementType()
    if isinstance(elem, torch.OptionalType):
        elem = elem.getElementType()
    return isinstance(elem, torch.TensorType)


def _returns_tensors_only(schema) -> bool:
    for r in schema.returns:
        t = r.type
        if isinstance(t, torch.OptionalType):
            t = t.getElementType()
        if not (isinstance(t, torch.TensorType) or _is_tensor_list_type(t)):
            return False
    return True


class StepRecorder(TorchDispatchMode):
    """Records the calls made while active. `inputs` become slots 0..n-1; `is_constant(t)` says
    whether an unknown tensor may be baked in as a constant."""

    def __init__(self, inputs: list[torch.Tensor], is_constant: Callable[[torch.Tensor], bool]) -> None:
        super().__init__()
        self.recording = Recording(num_inputs=len(inputs))
        self._is_constant = is_constant
        self._slot_of: dict[int, int] = {}
        self._alive: list[torch.Tensor] = []  # keeps ids unique while recording
        self._num_slots = 0
        for t in inputs:
            self._new_slot(t)

    def _new_slot(self, t: torch.Tensor) -> int:
        slot = self._num_slots
        self._num_slots += 1
        self._slot_of[id(t)] = slot
        self._alive.append(t)
        return slot

    def slot(self, t: torch.Tensor) -> int:
        """The slot holding `t` (for the caller to name the outputs)."""
        try:
            return self._slot_of[id(t)]
        except KeyError:
            raise CaptureError("an output of the step was not produced by a recorded call") from None

    def _tensor(self, t: torch.Tensor, where: str) -> tuple:
        slot = self._slot_of.get(id(t))
        if slot is not None:
            return ("s", slot)
        if self._is_constant(t):
            return ("c", t)
        raise CaptureError(f"{where}: a tensor of unknown origin {tuple(t.shape)} {t.dtype} (not a step input, not "
                           "produced by a recorded op, not a declared constant such as a weight or KV cache)")

    def _argument(self, value: Any, schema_arg, where: str) -> tuple:
        if isinstance(value, torch.Tensor):
            return self._tensor(value, where)
        if _is_tensor_list_type(schema_arg.type) and value is not None:
            return ("l", [("n",) if v is None else self._tensor(v, where) for v in value])
        return ("c", value)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        where = f"{schema.name}.{schema.overload_name or 'default'}"
        if not _returns_tensors_only(schema):
            raise CaptureError(f"{where} returns a Python value (tensor data read into Python): not replayable")
        encoded = []
        for i, a in enumerate(schema.arguments):
            if i < len(args) and not a.kwarg_only:
                encoded.append(self._argument(args[i], a, where))
            elif a.name in kwargs:
                encoded.append(self._argument(kwargs[a.name], a, where))
            elif a.has_default_value():
                encoded.append(("d",))
            else:
                raise CaptureError(f"{where}: argument {a.name!r} missing")
        out = func(*args, **kwargs)
        if func is _DETACH and not args[0].requires_grad and id(args[0]) in self._slot_of:
            # a detach of a tensor without autograd history is the same tensor for every later op: alias
            # the slot instead of replaying a call (torch.empty under a dispatch mode adds one per tensor)
            self._slot_of[id(out)] = self._slot_of[id(args[0])]
            self._alive.append(out)
            return out
        num_returns = len(schema.returns)
        rets = () if num_returns == 0 else (out,) if num_returns == 1 else out
        outputs: list[tuple[int, int, int]] = []
        for r, value in enumerate(rets):
            if isinstance(value, torch.Tensor):
                outputs.append((r, -1, self._new_slot(value)))
            elif isinstance(value, (list, tuple)):
                outputs.extend((r, j, self._new_slot(v)) for j, v in enumerate(value))
        name = schema.name if "::" in schema.name else f"aten::{schema.name}"
        self.recording.calls.append(RecordedCall(name, schema.overload_name, encoded, outputs))
        return out


def iter_tensors(obj: Any, _seen: set | None = None) -> Iterable[torch.Tensor]:
    """Every tensor reachable from `obj` through modules (parameters, buffers, tensor attributes),
    lists, tuples, dicts, dataclass-like objects and `tensors()` methods."""
    seen = set() if _seen is None else _seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, torch.nn.Module):
        for m in obj.modules():
            for v in m.__dict__.values():
                if isinstance(v, dict) and v is not m.__dict__:
                    for t in v.values():
                        yield from iter_tensors(t, seen)
                elif isinstance(v, (torch.Tensor, list, tuple)):
                    yield from iter_tensors(v, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_tensors(v, seen)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_tensors(v, seen)
    elif callable(getattr(obj, "tensors", None)):
        yield from iter_tensors(list(obj.tensors()), seen)
    elif hasattr(obj, "__dict__"):
        for v in vars(obj).values():
            if isinstance(v, (torch.Tensor, list, tuple, dict)) or hasattr(v, "__dict__"):
                yield from iter_tensors(v, seen)
