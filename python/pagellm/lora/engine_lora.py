"""The engine's side of LoRA: adapters by name, which requests use which, slot assignment, admission.

The C++ scheduler knows nothing of adapters, so the limit of `max_loras` distinct adapters per step is
kept here, before scheduling: a request is handed to the scheduler only while the adapters of the requests
already there plus its own fit in `max_loras` slots; others wait here (FCFS among themselves) until a
request of an active adapter finishes. Every step therefore sees at most `max_loras` adapters, each with a
slot of its own. Prefix caching stays on: each adapter version has its own block-hash extra key, so blocks
are never shared between adapters (nor with the base model, nor with an adapter's replaced weights).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from pagellm.lora.config import LoRAConfig
from pagellm.lora.request import LoRARequest


@dataclass(frozen=True)
class LoadedAdapter:
    name: str
    int_id: int
    path: str
    extra_key: int  # the prefix-cache key of this version of the adapter (new on every load)


class EngineLoRA:
    """Held by LLMEngine as `engine.lora` (None without enable_lora). `rpc(method, args)` reaches the workers."""

    def __init__(self, config: LoRAConfig, rpc: Callable[..., list], rng: random.Random) -> None:
        self.config = config
        self._rpc = rpc
        self._rng = rng
        self.adapters: dict[str, LoadedAdapter] = {}
        self.request_adapter: dict[str, str] = {}   # request id -> adapter name (scheduled or waiting here)
        self.waiting: dict[str, Callable[[], None]] = {}  # request id -> hands it to the scheduler (FCFS)
        self.active: dict[str, int] = {}            # adapter -> its requests in the scheduler
        self.slot_of: dict[str, int] = {}           # adapter -> slot its weights are in

    # ---- adapters ------------------------------------------------------------------------------
    def load(self, name: str, path: str, int_id: int | None = None) -> dict[str, Any]:
        """Load or replace adapter `name` on every worker (all checks first: on ValueError nothing changed)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"LoRA name must be a non-empty str, got {name!r}")
        infos = self._rpc("add_lora", (name, str(path)))
        old = self.adapters.get(name)
        if int_id is None:
            int_id = old.int_id if old else max((a.int_id for a in self.adapters.values()), default=0) + 1
        self.adapters[name] = LoadedAdapter(name, int(int_id), str(path), self._rng.getrandbits(63) + 1)
        return infos[0]

    def remove(self, name: str) -> None:
        if name not in self.adapters:
            raise ValueError(f"unknown LoRA adapter {name!r}; loaded: {sorted(self.adapters)}")
        if name in self.request_adapter.values():
            raise ValueError(f"LoRA adapter {name!r} is in use by unfinished requests")
        self._rpc("remove_lora", (name,))
        del self.adapters[name]
        self.slot_of.pop(name, None)

    def resolve(self, lora_request: LoRARequest | None) -> LoadedAdapter | None:
        """The loaded adapter a request names (loading it from `lora_path` on first use); ValueError if unknown."""
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest or None, got {type(lora_request).__name__}")
        name = lora_request.lora_name
        if name not in self.adapters:
            if not lora_request.lora_path:
                raise ValueError(f"unknown LoRA adapter {name!r} (and no lora_path to load it from); "
                                 f"loaded: {sorted(self.adapters)}")
            self.load(name, lora_request.lora_path, lora_request.lora_int_id)
        return self.adapters[name]

    # ---- requests ------------------------------------------------------------------------------
    def submit(self, request_id: str, name: str, hand_to_scheduler: Callable[[], None]) -> None:
        """Hand the request to the scheduler now if its adapter fits the slots, else keep it waiting here."""
        if self._can_admit(name):
            self._activate(name)
            try:
                hand_to_scheduler()
            except BaseException:
                self._deactivate(name)
                raise
        else:
            self.waiting[request_id] = hand_to_scheduler
        self.request_adapter[request_id] = name

    def release(self, request_id: str) -> None:
        """The request finished or was aborted (a no-op for requests without an adapter)."""
        name = self.request_adapter.pop(request_id, None)
        if name is None:
            return
        if self.waiting.pop(request_id, None) is None:
            self._deactivate(name)

    def admit_waiting(self) -> None:
        """Before each schedule: hand over the waiting requests whose adapter now fits."""
        for request_id in list(self.waiting):
            name = self.request_adapter[request_id]
            if self._can_admit(name):
                self._activate(name)
                self.waiting.pop(request_id)()

    def row_slots(self, seq_ids: list[str]) -> np.ndarray | None:
        """int32 slot per scheduled row (-1: no adapter); None when no row uses one."""
        if not self.active:
            return None
        names = [self.request_adapter.get(sid.split("#", 1)[0]) for sid in seq_ids]
        if not any(names):
            return None
        return np.asarray([-1 if n is None else self.slot_of[n] for n in names], dtype=np.int32)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def _can_admit(self, name: str) -> bool:
        return name in self.active or len(self.active) < self.config.max_loras

    def _activate(self, name: str) -> None:
        if name in self.active:
            self.active[name] += 1
            return
        slot = self.slot_of.get(name)
        if slot is None:  # a slot no active adapter holds (_can_admit guarantees one)
            busy = {self.slot_of[a] for a in self.active}
            slot = next(s for s in range(self.config.max_loras) if s not in busy)
            self.slot_of = {a: s for a, s in self.slot_of.items() if s != slot}
        self._rpc("set_lora_slot", (slot, name))  # a no-op on the worker when the slot holds it already
        self.slot_of[name] = slot
        self.active[name] = 1

    def _deactivate(self, name: str) -> None:
        self.active[name] -= 1
        if self.active[name] == 0:
            del self.active[name]  # its weights stay in the slot until another adapter needs it


class LoRAEngineMethods:
    """LLMEngine's LoRA methods (mixed in; uses `self.lora`, an EngineLoRA or None)."""

    lora: EngineLoRA | None = None

    def _resolve_lora(self, lora_request) -> LoadedAdapter | None:
        if lora_request is None:
            return None
        if self.lora is None:
            raise ValueError("lora_request given but LoRA is not enabled (EngineArgs(enable_lora=True))")
        return self.lora.resolve(lora_request)

    def add_lora(self, name: str, path: str, lora_int_id: int | None = None) -> dict:
        """Load PEFT adapter `name` from directory `path`, or replace the loaded one of that name in place
        (between steps). Every check runs first: on ValueError the old adapters and weights are intact."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled (EngineArgs(enable_lora=True))")
        return self.lora.load(name, path, lora_int_id)

    def remove_lora(self, name: str) -> None:
        if self.lora is None:
            raise ValueError("LoRA is not enabled (EngineArgs(enable_lora=True))")
        self.lora.remove(name)

    def list_loras(self) -> list[str]:
        return [] if self.lora is None else sorted(self.lora.adapters)
