"""The epilogue primitives, one module per family. Importing this package registers them all.

Modules are discovered, not listed: a new family is a new module here (and its test).
"""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
