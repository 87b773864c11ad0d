"""Which replica serves a request, for data-parallel serving (`pagellm serve --data-parallel-size N`).

    router = make_router("least_loaded", num_replicas=2)     # or "prefix"
    i = router.pick(body, alive=[True, True])                # body: the request's parsed JSON (or None)
    router.started(i); ...; router.finished(i)               # the front counts what each replica is serving

Policies (ROUTING_POLICIES):
    least_loaded  the live replica with the fewest requests in flight (counted by the front itself, so no
                  replica is asked); ties go to the one that was sent the fewest requests so far, which spreads
                  sequential requests round-robin
    prefix        a stable hash of the prompt's first `prefix_chars` characters (completions: the prompt; chat:
                  the messages' roles and text) picks the replica, so requests sharing a prefix meet the same
                  prefix cache; when that replica has `max_imbalance` more requests in flight than the least
                  loaded one (or is dead), the request goes least-loaded instead
All state is touched on the front's event loop only.
"""

from __future__ import annotations

import hashlib
import json

ROUTING_POLICIES = ("least_loaded", "prefix")
DEFAULT_PREFIX_CHARS = 256
DEFAULT_MAX_IMBALANCE = 4


class LeastLoadedRouter:
    def __init__(self, num_replicas: int) -> None:
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be an integer >= 1, got {num_replicas!r}")
        self.num_replicas = num_replicas
        self.in_flight = [0] * num_replicas
        self.routed = [0] * num_replicas   # requests sent to each replica so far

    def pick(self, body: object, alive: list[bool]) -> int | None:
        """The replica for this request; None when no replica is alive. `alive[i]`: replica i can serve."""
        return self.least_loaded(alive)

    def least_loaded(self, alive: list[bool]) -> int | None:
        live = [i for i in range(self.num_replicas) if alive[i]]
        if not live:
            return None
        return min(live, key=lambda i: (self.in_flight[i], self.routed[i], i))

    def started(self, i: int) -> None:
        self.in_flight[i] += 1
        self.routed[i] += 1

    def finished(self, i: int) -> None:
        self.in_flight[i] -= 1


class PrefixRouter(LeastLoadedRouter):
    def __init__(self, num_replicas: int, prefix_chars: int = DEFAULT_PREFIX_CHARS,
                 max_imbalance: int = DEFAULT_MAX_IMBALANCE) -> None:
        if prefix_chars < 1 or max_imbalance < 0:
            raise ValueError(f"prefix_chars must be >= 1 and max_imbalance >= 0, got {prefix_chars}, {max_imbalance}")
        super().__init__(num_replicas)
        self.prefix_chars = prefix_chars
        self.max_imbalance = max_imbalance

    def pick(self, body: object, alive: list[bool]) -> int | None:
        fallback = self.least_loaded(alive)
        key = prompt_prefix(body, self.prefix_chars)
        if fallback is None or key is None:
            return fallback
        digest = hashlib.blake2b(key.encode("utf-8", "replace"), digest_size=8).digest()
        preferred = int.from_bytes(digest, "little") % self.num_replicas
        if not alive[preferred] or self.in_flight[preferred] - self.in_flight[fallback] > self.max_imbalance:
            return fallback
        return preferred


def prompt_prefix(body: object, num_chars: int) -> str | None:
    """The first `num_chars` characters of a completion prompt or of a chat's messages (role and text of each,
    in order); None for a body with neither (it is routed least-loaded)."""
    if not isinstance(body, dict):
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:  # a batch of prompts, or one prompt as token ids
        prompt = prompt[0] if isinstance(prompt[0], (str, list)) else prompt
    if isinstance(prompt, list):
        prompt = " ".join(str(t) for t in prompt[:num_chars])
    if isinstance(prompt, str):
        return prompt[:num_chars]
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if isinstance(m, dict):
                content = m.get("content")
                text = content if isinstance(content, str) else json.dumps(content, sort_keys=True)
                parts.append(f"{m.get('role')}:{text}\n")
            if sum(map(len, parts)) >= num_chars:
                break
        return "".join(parts)[:num_chars]
    return None


def make_router(policy: str, num_replicas: int, **kwargs) -> LeastLoadedRouter:
    """A router of one of ROUTING_POLICIES; kwargs go to PrefixRouter (prefix_chars, max_imbalance)."""
    if policy == "least_loaded":
        return LeastLoadedRouter(num_replicas)
    if policy == "prefix":
        return PrefixRouter(num_replicas, **kwargs)
    raise ValueError(f"unknown routing policy {policy!r}; allowed: {list(ROUTING_POLICIES)}")
