"""Classification: config checks and model building (``setup``), the entry ``run_cls`` and its
training loop (``trainer``), top-1 evaluation (``evaluation``)."""

from visattn.engine.cls.trainer import run_cls

__all__ = ["run_cls"]
