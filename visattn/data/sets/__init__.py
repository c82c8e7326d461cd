"""The built-in array datasets: every module in this package registers one on import.

Importing the package imports them all, so a new built-in dataset is a new module here (plus its
``conf/data/<name>.yaml``) and no list elsewhere.
"""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
