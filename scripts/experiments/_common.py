"""The GPU scripts' start and finish (``scripts/gpu/_common.py``) for the experiments here, which
import ``_common`` from their own folder: one copy, loaded from there."""

import importlib.util
import os
import sys

_path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu", "_common.py")
_spec = importlib.util.spec_from_file_location("scripts_gpu_common", _path)
_module = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)

Checker, finish, script_setup = _module.Checker, _module.finish, _module.script_setup
