"""What a training run dir recorded, for the modes that read one back (``ckpt=RUN_DIR``).

``python train_cls.py mode=eval ckpt=RUN_DIR`` (and ``train_dit.py mode=sample / eval``) must score the
model the run trained, not the config defaults: an MHA run's weights also load into a MoH model (its
routers left at their initialisation), which would then be scored silently as another model. So
these modes take the run's own groups (model, attention, budget, data, ...) from the config it
recorded, and apply the keys given on the command line on top of them:

    python train_cls.py mode=eval ckpt=RUN_DIR                       # the run's model on the run's data
    python train_cls.py mode=eval ckpt=RUN_DIR data=imagefolder ...  # the run's model on other data

A group named on the command line (``attn=moh``) is the command line's as a whole; a key inside one
(``eval.num_samples=50000``) replaces just that key of the run's group.

Also here: refusing a mode that would overwrite a training run's ``results.json``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from .checkpoints import CHECKPOINT_DIR
from .results import RESULTS_FILE

log = logging.getLogger(__name__)

HYDRA_CONFIG = Path(".hydra") / "config.yaml"
_ABSENT = object()


def recorded_mode(results: Any) -> str | None:
    """The mode a results.json was written by (older files without ``mode``: train when they count steps)."""
    if not isinstance(results, dict):
        return None
    return results.get("mode") or (results.get("config") or {}).get("mode") or (
        "train" if "train_steps" in results else None)


def refuse_to_overwrite_training(run_dir: str | Path, mode: str) -> None:
    """A mode other than train writes results.json too: into a training run's dir it would replace
    that run's results. ValueError naming the dir and the fix."""
    existing = Path(run_dir) / RESULTS_FILE
    if mode == "train" or not existing.is_file():
        return
    try:
        recorded = json.loads(existing.read_text())
    except (OSError, ValueError):
        return
    if recorded_mode(recorded) == "train":
        raise ValueError(f"{run_dir} holds a training run's results.json, which mode={mode} would replace; "
                         f"give this run its own directory (hydra.run.dir=...; ckpt={run_dir} reads that run)")


def training_run_dir(ckpt: str | Path) -> Path | None:
    """The run dir behind ``ckpt``: the run dir itself, a checkpoint folder ``RUN_DIR/checkpoints/step-N``,
    or a file in either; None when ``ckpt`` is not part of a run dir (e.g. a downloaded weight file)."""
    path = Path(ckpt)
    folder = path if path.is_dir() else path.parent
    if folder.parent.name == CHECKPOINT_DIR:
        folder = folder.parent.parent
    if (folder / RESULTS_FILE).is_file() or (folder / HYDRA_CONFIG).is_file():
        return folder
    return None


def training_config(run_dir: Path) -> tuple[dict[str, Any], Path] | None:
    """The config a training run recorded and the file it came from: results.json's resolved copy when
    the run has written it, else the config Hydra saved when the run started; None when neither is a
    training's (a run dir of an eval, or one without records)."""
    results_path = run_dir / RESULTS_FILE
    if results_path.is_file():
        try:
            results = json.loads(results_path.read_text())
        except (OSError, ValueError) as err:
            log.warning("%s cannot be read (%s); using %s", results_path, err, run_dir / HYDRA_CONFIG)
        else:
            config = results.get("config") if isinstance(results, dict) else None
            if isinstance(config, dict) and recorded_mode(results) == "train":
                return config, results_path
    hydra_path = run_dir / HYDRA_CONFIG
    if hydra_path.is_file():
        config = OmegaConf.to_container(OmegaConf.load(hydra_path))
        if isinstance(config, dict) and config.get("mode") == "train":
            return config, hydra_path
    return None


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def override_keys(overrides: Sequence[str]) -> list[str]:
    """The config keys (or groups) a list of Hydra command-line overrides sets, e.g.
    ``["attn=mha", "+model.kwargs.depth=2"]`` -> ``["attn", "model.kwargs.depth"]``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return [o.key_or_group for o in OverridesParser.create().parse_overrides(overrides=list(overrides))]


def adopt_training_config(
    cfg: DictConfig, groups: Sequence[str], overrides: Sequence[str], modes: Sequence[str]
) -> DictConfig:
    """``cfg`` with ``groups`` taken from the training run that ``cfg.ckpt`` belongs to, in the ``modes``
    that read a checkpoint back; ``overrides`` (the command line) keep precedence key by key. Returns
    ``cfg`` unchanged in other modes, or when ``ckpt`` is not a training run's (a bare weight file)."""
    if cfg.get("mode") not in modes or not cfg.get("ckpt"):
        return cfg
    run_dir = training_run_dir(cfg.ckpt)
    found = training_config(run_dir) if run_dir is not None else None
    if found is None:
        return cfg
    recorded, source = found
    given = override_keys(overrides)
    adopted = []
    for group in groups:
        if group not in recorded or group in given:
            continue
        merged = OmegaConf.create({group: recorded[group]})
        for key in (k for k in given if k.startswith(group + ".")):
            value = OmegaConf.select(cfg, key, default=_ABSENT)
            if value is _ABSENT:  # the command line deleted it (~key)
                parent, _, leaf = key.rpartition(".")
                node = OmegaConf.select(merged, parent)
                if isinstance(node, DictConfig) and leaf in node:
                    del node[leaf]
            else:
                OmegaConf.update(merged, key, value, force_add=True)
        if group not in cfg or _plain(merged[group]) != _plain(cfg[group]):
            adopted.append(group)
        with open_dict(cfg):
            cfg[group] = merged[group]
    if adopted:
        log.info("ckpt=%s: %s as its training run recorded them (%s); name a key on the command line to "
                 "change it", cfg.ckpt, ", ".join(adopted), source)
    return cfg
