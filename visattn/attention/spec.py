"""Per-layer attention specs: split a spec ``{"name": ..., **kwargs}`` into one kwargs dict per layer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .registry import check_attention_keywords, get_attention_class


def _is_sequence(value: Any) -> bool:
    """Lists, tuples and OmegaConf's ListConfig; not strings."""
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def expand_per_layer(name: str, kwargs: Mapping[str, Any], depth: int, unit: str = "layer") -> list[dict[str, Any]]:
    """Split an attention spec into one kwargs dict per layer (or per stage, ``unit="stage"``).

    A list or tuple value gives one entry per layer and must have exactly ``depth`` entries; a
    scalar applies to every layer. Keywords that take a sequence themselves (a class's
    ``list_kwargs``, e.g. ``head_dims``) are per-layer only when given as a list of sequences.
    """
    list_valued = set(getattr(get_attention_class(name), "list_kwargs", ()))
    layers: list[dict[str, Any]] = [{} for _ in range(depth)]
    for key, value in kwargs.items():
        per_layer = _is_sequence(value) and (key not in list_valued or (len(value) > 0 and _is_sequence(value[0])))
        if per_layer and len(value) != depth:
            raise ValueError(
                f"attn.{key} has {len(value)} entries but the model has {depth} {unit}s; "
                f"give one value per {unit} or a single value for all"
            )
        for i in range(depth):
            layers[i][key] = value[i] if per_layer else value
    return layers


def _plain(value: Any) -> Any:
    """Config containers (e.g. OmegaConf's) -> plain dicts and lists."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if _is_sequence(value):
        return [_plain(v) for v in value]
    return value


def parse_attn_spec(attn: str | Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """``"moh"`` or ``{"name": "moh", **kwargs}`` -> (name, kwargs); checks the name is registered.
    A ``None`` value is passed on: every variant reads it as "its default"."""
    if isinstance(attn, str):
        name, kwargs = attn, {}
    elif isinstance(attn, Mapping):
        kwargs = _plain(attn)
        name = kwargs.pop("name", None)
        if not isinstance(name, str):
            raise ValueError(f"attention spec {dict(attn)} has no 'name'; give e.g. {{'name': 'moh', ...}}")
    else:
        raise ValueError(f"attn={attn!r} must be a registered name or a dict with a 'name' key")
    check_attention_keywords(name, kwargs)
    return name, kwargs


def per_layer_values(value: Any, depth: int, key: str) -> list[Any]:
    """One value per layer from a single value or a list of ``depth`` values (e.g. ``num_heads``)."""
    if not _is_sequence(value):
        return [value] * depth
    values = list(value)
    if len(values) != depth:
        raise ValueError(
            f"{key} has {len(values)} entries but the model has {depth} layers; give one per layer or a single value"
        )
    return values
