"""Head budgets in one place: the published MoH ones and ours, for every model and both tasks.

A head budget says, per layer (or per stage of a hierarchical model), how many heads are always on
(``shared_heads``, the first ones by index) and how many of the remaining pool each token routes to
(``routed_topk``; 0 = a dense layer with soft per-token head weights). Some budgets also fix the head
geometry they were written for (heads per layer and head width: MoH-DiT-L/XL's head pyramids, our
demo pyramid).

This module is the single source of those numbers:
- ``create_dit("MoH-DiT-S/2-90")`` and the other DiT presets read them (``visattn.models.dit``);
- ``conf/budget/NAME.yaml`` names a registered budget (``name: s_75``) and holds no lists of its own;
- both training set-ups apply a budget to a model's keywords with ``apply_budget``.
Python rather than YAML because the library must work without Hydra and without the ``conf/`` tree,
which is not installed with the package: presets, TransNeXt's MoH-ViT models and user code read the
budgets from here, and a config only picks one by name (or writes its own lists, a budget of its own).

Numbers: the MoH release (arXiv 2410.11842 and its code), as tabulated in the project's
``reference/moh_budgets.md``; ours are marked as such.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from visattn.attention import parse_attn_spec
from visattn.attention.routing import validate_budget

log = logging.getLogger(__name__)

ROUTING_KEYS = ("shared_heads", "routed_topk")  # keywords of the attention
GEOMETRY_KEYS = ("num_heads", "head_dim")  # keywords of the model
BUDGET_KEYS = ("num_heads", "shared_heads", "routed_topk")  # what a config's budget may set
NO_BUDGET = "none"


@dataclass(frozen=True)
class HeadBudget:
    """A registered head budget; every tuple has one entry per layer (``unit="layer"``) or stage.

    Args:
        name: the canonical name (e.g. ``"MoH-DiT-S/2-90"``).
        shared_heads, routed_topk: per entry.
        heads: heads per entry in the geometry the budget was written for.
        sets_geometry: applying the budget also sets the model's ``num_heads = heads`` (and
            ``head_dim`` when given): the budget is meaningless on another head count.
        head_dim: per-head width that geometry needs (MoH-DiT-L/XL: 64 / 72); None = width / heads.
        blocks: blocks per entry, for per-stage budgets (counts heads in the activation ratio).
        unit: ``"layer"`` or ``"stage"`` (TransNeXt takes one value per stage).
        source: where the numbers come from.
    """

    name: str
    shared_heads: tuple[int, ...]
    routed_topk: tuple[int, ...]
    heads: tuple[int, ...]
    sets_geometry: bool = False
    head_dim: int | None = None
    blocks: tuple[int, ...] | None = None
    unit: str = "layer"
    source: str = ""

    def __post_init__(self) -> None:
        lengths = {len(self.shared_heads), len(self.routed_topk), len(self.heads), len(self.blocks or self.heads)}
        if len(lengths) != 1:
            raise ValueError(f"budget {self.name}: shared_heads, routed_topk, heads and blocks differ in length")
        for i, (h, s, k) in enumerate(zip(self.heads, self.shared_heads, self.routed_topk, strict=True)):
            try:
                validate_budget(h, s, k)
            except ValueError as err:
                raise ValueError(f"budget {self.name}, {self.unit} {i}: {err}") from None

    @property
    def depth(self) -> int:
        """Entries: layers, or stages for ``unit="stage"``."""
        return len(self.shared_heads)

    def active_heads(self) -> tuple[int, int]:
        """(heads active per token, heads) summed over every block of the geometry."""
        blocks = self.blocks or (1,) * self.depth
        active = sum(n * (s + k) for n, s, k in zip(blocks, self.shared_heads, self.routed_topk, strict=True))
        return active, sum(n * h for n, h in zip(blocks, self.heads, strict=True))

    @property
    def ratio(self) -> float:
        """Activation ratio: active heads / heads."""
        active, total = self.active_heads()
        return active / total

    def geometry(self) -> dict[str, Any]:
        """Model keywords of the head geometry: ``num_heads`` per entry, ``head_dim`` when fixed."""
        out: dict[str, Any] = {"num_heads": list(self.heads)}
        if self.head_dim is not None:
            out["head_dim"] = self.head_dim
        return out

    def values(self) -> dict[str, Any]:
        """What applying the budget sets: the routing lists, plus the geometry when it fixes one."""
        out: dict[str, Any] = {"shared_heads": list(self.shared_heads), "routed_topk": list(self.routed_topk)}
        return {**(self.geometry() if self.sets_geometry else {}), **out}


def _repeat(*runs: tuple[int, int]) -> tuple[int, ...]:
    """_repeat((8, 9), (16, 10)) -> (8,)*9 + (16,)*10."""
    return tuple(value for value, count in runs for _ in range(count))


_MOH = "MoH release (arXiv 2410.11842), reference/moh_budgets.md"
# MoH-DiT-L/XL head pyramids: heads per layer and head width (the Pyramid-DiT presets reuse them).
_PYRAMID_L = _repeat((8, 8), (16, 8), (24, 8))
_PYRAMID_XL = _repeat((8, 9), (16, 10), (24, 9))

_BUDGETS: tuple[HeadBudget, ...] = (
    # MoH-DiT, per layer (S and B keep DiT's heads; L and XL use the head pyramids above).
    HeadBudget("MoH-DiT-S/2-90", _repeat((3, 8), (6, 4)), _repeat((2, 8), (0, 4)), (6,) * 12, source=_MOH),
    HeadBudget("MoH-DiT-S/2-75", (2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 6, 6), (1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 0, 0),
               (6,) * 12, source=_MOH),
    HeadBudget("MoH-DiT-B/2-90", (6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 12, 12), _repeat((4, 10), (0, 2)), (12,) * 12,
               source=_MOH),
    HeadBudget("MoH-DiT-B/2-75", _repeat((4, 2), (6, 8), (12, 2)), _repeat((2, 2), (3, 8), (0, 2)), (12,) * 12,
               source=_MOH),
    HeadBudget("MoH-DiT-L/2-90", _repeat((8, 8), (16, 8), (16, 8)), _repeat((0, 16), (3, 8)), _PYRAMID_L,
               sets_geometry=True, head_dim=64, source=_MOH),
    HeadBudget("MoH-DiT-L/2-75", _repeat((8, 8), (8, 8), (12, 8)), _repeat((0, 8), (4, 16)), _PYRAMID_L,
               sets_geometry=True, head_dim=64, source=_MOH),
    HeadBudget("MoH-DiT-XL/2-90", _repeat((8, 9), (16, 10), (16, 9)), _repeat((0, 19), (3, 9)), _PYRAMID_XL,
               sets_geometry=True, head_dim=72, source=_MOH),
    HeadBudget("MoH-DiT-XL/2-75", _repeat((8, 9), (10, 10), (14, 9)), _repeat((0, 9), (2, 19)), _PYRAMID_XL,
               sets_geometry=True, head_dim=72, source=_MOH),
    # Ours, for the tiny DiT (6 layers x 4 heads): fewer active heads in shallow layers, 18/24 = 75%.
    HeadBudget("MoH-DiT-T/2-75", (1, 1, 2, 2, 2, 4), (1, 2, 1, 1, 1, 0), (4,) * 6, source="ours"),
    # MoH-ViT on TransNeXt, per stage (every block of a stage alike).
    HeadBudget("MoH-ViT-S-80", (3, 6, 3, 8), (0, 0, 6, 12), (3, 6, 12, 24), blocks=(5, 5, 22, 5), unit="stage",
               source=_MOH),
    HeadBudget("MoH-ViT-S-75", (3, 6, 3, 4), (0, 0, 6, 12), (3, 6, 12, 24), blocks=(5, 5, 22, 5), unit="stage",
               source=_MOH),
    HeadBudget("MoH-ViT-B-75", (4, 8, 4, 5), (0, 0, 8, 16), (4, 8, 16, 32), blocks=(5, 5, 23, 5), unit="stage",
               source=_MOH),
    HeadBudget("MoH-ViT-B-50", (2, 2, 2, 4), (2, 4, 6, 8), (4, 8, 16, 32), blocks=(5, 5, 23, 5), unit="stage",
               source=_MOH),
    # Ours, for model=vit_tiny_patch2_8 (6 layers x 8 heads, width 64).
    HeadBudget("demo_62", (2, 2, 3, 3, 4, 4), (2, 2, 2, 2, 2, 2), (8,) * 6,
               source="ours: fewer shared heads early, 30/48 heads active"),
    HeadBudget("demo_pyramid_75", (2, 2, 4, 4, 8, 8), (1, 1, 2, 2, 4, 4), (4, 4, 8, 8, 16, 16), sets_geometry=True,
               source="ours: heads per layer 4,4,8,8,16,16, 42/56 heads active"),
)
# conf/budget names: MoH-DiT-S/B's budgets on the same geometry (ViT-S / DeiT-S, ViT-B / DeiT-B).
_ALIASES = {"s_90": "MoH-DiT-S/2-90", "s_75": "MoH-DiT-S/2-75", "b_90": "MoH-DiT-B/2-90", "b_75": "MoH-DiT-B/2-75"}
_REGISTRY: Mapping[str, HeadBudget] = {b.name: b for b in _BUDGETS}


def list_budgets(aliases: bool = False) -> list[str]:
    """Registered budget names in registry order (with ``aliases``: the short config names too)."""
    return [*_REGISTRY, *(_ALIASES if aliases else ())]


def get_budget(name: str) -> HeadBudget:
    """The registered budget called ``name`` (canonical or a ``conf/budget`` alias)."""
    budget = _REGISTRY.get(_ALIASES.get(name, name))
    if budget is None:
        raise ValueError(
            f"unknown head budget {name!r}; registered: {', '.join(list_budgets(aliases=True))} "
            f"(or give the lists yourself: {{'name': ..., 'shared_heads': [...], 'routed_topk': [...]}})"
        )
    return budget


def _plain(value: Any) -> Any:
    """Config containers (e.g. OmegaConf's) -> plain dicts and lists."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [_plain(v) for v in value]
    return value


def resolve_budget(budget: str | Mapping[str, Any] | HeadBudget | None) -> tuple[str, dict[str, Any]]:
    """``(name, values)``: the model / attention keywords the budget sets (empty: no budget).

    ``budget``: None or ``"none"``; a registered name; a ``HeadBudget``; or a mapping as in
    ``conf/budget/*.yaml`` (``name`` plus ``num_heads`` / ``shared_heads`` / ``routed_topk``, each
    null, an int or a per-layer list). A mapping with a registered name starts from that budget and
    its non-null keys replace the registered lists; with another name (``none``) its lists are the
    whole budget.
    """
    if budget is None:
        return NO_BUDGET, {}
    if isinstance(budget, HeadBudget):
        return budget.name, budget.values()
    if isinstance(budget, str):
        return (NO_BUDGET, {}) if budget == NO_BUDGET else (budget, get_budget(budget).values())
    if not isinstance(budget, Mapping):
        raise ValueError(f"budget={budget!r} must be a budget name, a mapping of per-layer lists, or None")
    spec = _plain(budget)
    name = str(spec.pop("name", None) or NO_BUDGET)
    unknown = sorted(set(spec) - set(BUDGET_KEYS))
    if unknown:
        raise ValueError(f"budget={name} has unknown keys {unknown}; a budget sets only {list(BUDGET_KEYS)}")
    given = {k: v for k, v in spec.items() if v is not None}
    if name == NO_BUDGET:
        return name, given
    if name not in _REGISTRY and name not in _ALIASES and given:
        return name, given  # a budget of its own, written in the config
    return name, {**get_budget(name).values(), **given}


def _check_entries(name: str, key: str, value: Any, depth: int | None, unit: str) -> None:
    if depth is None or isinstance(value, (int, str)) or value is None:
        return
    if len(value) != depth:
        raise ValueError(
            f"attn.{key} has {len(value)} entries but the model has {depth} {unit}s (budget={name}); "
            f"pick a budget written for {depth} {unit}s, or budget={NO_BUDGET}"
        )


def apply_budget(
    model_kwargs: Mapping[str, Any],
    budget: str | Mapping[str, Any] | HeadBudget | None,
    depth: int | None = None,
    declared_only: bool = False,
    unit: str = "layer",
) -> dict[str, Any]:
    """A copy of a model's keywords with a head budget applied.

    Args:
        model_kwargs: keywords of a model built from the attention registry (``DiT``, the
            ``visattn_vit_*`` / TransNeXt timm models): ``attn`` (a registered name or
            ``{"name": ..., **kwargs}``) and possibly ``num_heads`` / ``head_dim``.
        budget: see ``resolve_budget``; None / ``"none"`` returns the keywords unchanged (a copy).
        depth: entries the model takes per-layer lists for (its layers; its stages with
            ``unit="stage"``); when given, every list of the budget must have that many entries.
        declared_only: the attention spec must already hold each routing key the budget sets
            (a config's attn group declares the keywords its attention takes, conf/attn/NAME.yaml),
            so a budget on an attention that does not route is refused instead of turning it into MoH.
        unit: ``"layer"`` or ``"stage"``, for messages.

    Returns:
        The keywords with ``attn = {"name": ..., **kwargs, "shared_heads": ..., "routed_topk": ...}``
        and, when the budget fixes a geometry, ``num_heads`` (and ``head_dim``). The budget's values
        replace the attention's or the model's own.
    """
    out = copy.deepcopy(dict(model_kwargs))
    name, values = resolve_budget(budget)
    if not values:
        return out
    for key, value in values.items():
        _check_entries(name, key, value, depth, unit)
    routing = {k: v for k, v in values.items() if k in ROUTING_KEYS}
    if routing:
        if out.get("attn") is None:
            raise ValueError(
                f"budget={name} routes heads but the model has no attention spec; give attn='moh' (or another "
                f"routed attention) or budget={NO_BUDGET}"
            )
        attn_name, attn_kwargs = parse_attn_spec(out["attn"])
        for key, value in routing.items():
            if declared_only and key not in attn_kwargs:
                raise ValueError(
                    f"budget={name} sets {key}={value}, but attn={attn_name} has no {key} "
                    f"(conf/attn/{attn_name}.yaml); use attn=moh (or another routed attention) or budget={NO_BUDGET}"
                )
            if attn_kwargs.get(key) is not None and attn_kwargs[key] != value:
                log.info("budget=%s replaces attn.%s=%s by %s", name, key, attn_kwargs[key], value)
        out["attn"] = {"name": attn_name, **attn_kwargs, **routing}
    for key in GEOMETRY_KEYS:
        if key in values:
            out[key] = values[key]
    return out
