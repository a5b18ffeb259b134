"""The planner's rewrite rules, one module per op (or per family of ops lowered together).
Importing this package registers them all (``registry.Rule``).

Modules are discovered, not listed: teaching the planner a new op is a new module here (and its
test).
"""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
