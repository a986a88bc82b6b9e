"""Import one of the repository's scripts (benchmarks/, scripts/) as a module, to test the
functions it holds without running it.

    load_script(path) -> module
        The script at `path`, executed once as a module named for its file, registered in
        sys.modules first (dataclasses resolve the module's annotations through it).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
