"""Prep steps: weight-layout transforms run at the start of each Program call (in training, every
step), chains of them fused by the runtime (``fusion.py``). Importing this registers them all."""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
