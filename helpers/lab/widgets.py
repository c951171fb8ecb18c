"""Interactive controls, shown where a person can move them and left out of headless runs.

``ipywidgets.interact`` under a headless executor (papermill, nbclient, Kaggle's "Save version")
can block the run for good (nbclient issue 312, papermill issue 723: a widget's comm messages and
the cell's reply crossing), and nobody is there to move a slider. ``explore`` shows the controls
in Jupyter, Colab or Kaggle's editor; in a headless run it says so in one line instead. The runner
(``python -m helpers run``) marks its notebooks' processes headless with ``HELPERS_HEADLESS=1``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

HEADLESS_ENV = "HELPERS_HEADLESS"


def headless(environ: Mapping[str, str] = os.environ) -> bool:
    """True in a run nobody watches: the suite's runner, or a Kaggle batch run ("Save version")."""
    return environ.get(HEADLESS_ENV) == "1" or environ.get("KAGGLE_KERNEL_RUN_TYPE") == "Batch"


def explore(fn: Callable, **controls):
    """``interact(fn, **controls)`` where a person can move them; in a headless run, one line
    saying where the controls are (the figure they start on is the one drawn above them)."""
    if headless():
        print("(Interactive controls: open this notebook in Jupyter, Colab or Kaggle's editor to use them.)")
        return None
    from ipywidgets import interact

    return interact(fn, **controls)


__all__ = ["HEADLESS_ENV", "headless", "explore"]
