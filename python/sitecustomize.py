"""Run by Python as it starts, in every Python worker of ddplaunch (ddplaunch puts this directory
on the workers' PYTHONPATH): it arms what ddplaunch_autostart.py describes, then runs the
sitecustomize this one hides (Debian's, a venv's), as Python would have without it."""

import os
import sys


def _run_hidden_sitecustomize():
    import importlib.machinery
    import importlib.util
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


try:
    import ddplaunch_autostart
    ddplaunch_autostart.install()
except Exception as e:  # noqa: B902 - the user's script runs whatever happened here
    sys.stderr.write("ddplaunch (rank %s): the worker start-up hook failed (%s: %s); steps are reported "
                     "only by ddplaunch.step()\n" % (os.environ.get("RANK", "?"), type(e).__name__, e))
_run_hidden_sitecustomize()
