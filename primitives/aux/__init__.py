"""Aux steps: tiny finishing kernels between GEMMs. Importing this package registers them all."""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
