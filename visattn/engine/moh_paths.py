"""``train.attn_paths``: the path MoH layers with ``attn.impl=auto`` train on, and the attention of every
softmax layer (SDPA or the small-heads kernel), the same for both tasks.

    dense  the masked dense path and SDPA (the default): a run is reproducible bit for bit.
    probe  at start, time each layer's training step on the masked dense path with SDPA, with the small-heads
           kernel, and (MoH) on the compiled routed kernel (``visattn.attention.train_paths``) and keep the
           fastest per layer. Like
           ``cudnn.benchmark``, two fresh runs may then choose differently and differ in the last
           bits; one run does not: every rank takes rank 0's choice, and results.json and every
           checkpoint keep it (``RECORD_KEY``), so a resumed run applies it again instead of probing.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch.nn as nn

from visattn.attention.train_paths import (
    apply_train_paths,
    attention_layers,
    choose_train_paths,
    describe,
    empty_record,
    probed_layers,
)

from .distributed import broadcast_object

log = logging.getLogger(__name__)

ATTN_PATHS = ("dense", "probe")

RECORD_KEY = "attention_train_paths"
# What a checkpoint written before runs recorded their training paths trained on.
BEFORE_RECORDS = empty_record("resumed from a checkpoint that records no training paths: masked dense, as it trained")


def saved_train_paths(state: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The record a resumed run's checkpoint ``state`` keeps (None for a fresh run)."""
    if state is None:
        return None
    return dict(state.get(RECORD_KEY) or BEFORE_RECORDS)


def check_attn_paths(setting: Any) -> str:
    """``train.attn_paths`` validated: ``dense`` or ``probe``."""
    if setting not in ATTN_PATHS:
        raise ValueError(f"train.attn_paths={setting!r} is not known; use {' or '.join(ATTN_PATHS)} "
                         "(probe: time MoH's compiled kernel per layer at start)")
    return setting


def settle_train_paths(
    model: nn.Module,
    setting: str,
    forward: Callable[[], object],
    autocast: Callable[[], contextlib.AbstractContextManager],
    saved: Mapping[str, Any] | None,
    compile: bool = False,
) -> dict[str, Any]:
    """Apply ``train.attn_paths`` (``setting``) to every MoH ``impl="auto"`` layer and softmax attention layer
    of ``model`` and return the record: under ``probe``, ``saved`` (a resumed run's) as it is, else rank 0's
    ``choose_train_paths(model, forward, autocast)``, or the masked dense path and SDPA everywhere with
    ``compile`` (the compiled graph would break at the kernels); under ``dense``, the masked dense path and
    SDPA. Call before wrapping the model in DDP or compiling it."""
    if check_attn_paths(setting) == "dense":
        record = empty_record("train.attn_paths=dense")
    elif saved is not None:
        record = dict(saved)
        for field, known in (("paths", probed_layers(model)), ("attention", attention_layers(model))):
            dropped = sorted(set(record.get(field) or {}) - set(known))
            if dropped:  # force_resume with another attn.impl: those layers now take what impl names
                log.warning("the saved training %s name layers that no longer probe (%s); ignoring them", field,
                            dropped)
                record[field] = {k: v for k, v in record[field].items() if k in known}
    elif compile:
        record = empty_record("train.compile: masked dense, in the compiled graph")
    else:
        record = broadcast_object(choose_train_paths(model, forward, autocast))
    apply_train_paths(model, record)
    if (probed_layers(model) or attention_layers(model)) and setting == "probe":
        log.info("Training paths: %s%s", describe(record), " (as the run chose at its start)" if saved else "")
    return record
