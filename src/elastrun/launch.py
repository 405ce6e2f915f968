"""``python -m elastrun.launch``: torch.distributed.launch's command line
(see :mod:`elastrun.launcher.legacy`).

``elastrun.launch`` is also the Python API function
(``elastrun.launch(config, entrypoint, *args)``). Importing this module makes
the package attribute this module, so the module is callable and does what
the function does: ``elastrun.launch(...)`` keeps working either way.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from elastrun.launcher.api import launch as _launch
from elastrun.launcher.legacy import main

__all__ = ["main"]


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _launch(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    raise SystemExit(main())
