"""Cross-layer KV sharing from an HF config: which layers read another layer's KV cache.

Two config fields (on a Llama / Mistral / Qwen2 / Qwen3 config.json; transformers keeps unknown fields):

    kv_sharing_layers:    {"5": 2, "6": 3}  sharing layer -> target layer (JSON keys are strings)
    num_kv_shared_layers: N                 Gemma 3n's meaning: each of the last N layers shares the cache
                                            of the last earlier non-shared layer of the same attention type
                                            (same window), translated to the map above

A sharing layer has a q projection only (no k_proj / v_proj in the checkpoint), writes no K/V and
attends over the keys and values its target wrote earlier in the same step; it allocates no KV
blocks (kv_cache.SharedKVSpec). Checked when the model is built, before any weight is read.
"""

from __future__ import annotations

from typing import Callable, Hashable

MAP_FIELD = "kv_sharing_layers"
COUNT_FIELD = "num_kv_shared_layers"


def _layer_id(value: object, num_layers: int, what: str) -> int:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < num_layers:
        raise ValueError(f"{MAP_FIELD}: {what} must be a layer index in [0, {num_layers}), got {value!r}")
    return value


def _map_from_count(count: object, num_layers: int, layer_kind: Callable[[int], Hashable]) -> dict[int, int]:
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count < num_layers:
        raise ValueError(f"{COUNT_FIELD} must be an integer in [0, {num_layers}) (num_hidden_layers - 1 at most), "
                         f"got {count!r}")
    first_shared = num_layers - count
    sharing: dict[int, int] = {}
    for layer in range(first_shared, num_layers):
        owners = [i for i in range(first_shared) if layer_kind(i) == layer_kind(layer)]
        if not owners:
            raise ValueError(f"{COUNT_FIELD}={count}: layer {layer} has no earlier non-shared layer of its attention "
                             f"type ({layer_kind(layer)!r}) to share the cache of")
        sharing[layer] = owners[-1]
    return sharing


def resolve_kv_sharing(config, num_layers: int, layer_kind: Callable[[int], Hashable]) -> dict[int, int]:
    """Sharing layer -> target layer from `config` ({} when neither field is set).

    layer_kind(i): what a layer's cache must match to be shared (e.g. (num_kv_heads, head_dim, window));
    a target of another kind is refused. Raises ValueError naming the field and the layer for a target
    that is not an earlier layer, is itself shared, or has another kind; for both fields set.
    """
    raw = getattr(config, MAP_FIELD, None)
    count = getattr(config, COUNT_FIELD, None)
    if raw and count:
        raise ValueError(f"set one of {MAP_FIELD} and {COUNT_FIELD}, not both (got {raw!r} and {count!r})")
    if count:
        return _map_from_count(count, num_layers, layer_kind)
    if not raw:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"{MAP_FIELD} must be a mapping {{sharing layer: target layer}}, got {type(raw).__name__}")
    sharing = {_layer_id(k, num_layers, "a sharing layer"): _layer_id(v, num_layers, f"the target of layer {k}")
               for k, v in raw.items()}
    for layer, target in sorted(sharing.items()):
        if target >= layer:
            raise ValueError(f"{MAP_FIELD}: layer {layer} shares the cache of layer {target}, which is not an earlier "
                             f"layer (a sharing layer reads what its target wrote before it in the same step)")
        if target in sharing:
            raise ValueError(f"{MAP_FIELD}: layer {layer} shares the cache of layer {target}, which is itself shared; "
                             f"point it at layer {sharing[target]}")
        if layer_kind(target) != layer_kind(layer):
            raise ValueError(f"{MAP_FIELD}: layer {layer} ({layer_kind(layer)!r}) cannot share the cache of layer "
                             f"{target} ({layer_kind(target)!r}): the cache shape (num_kv_heads, head_dim, window) "
                             f"must be the same")
    return sharing
