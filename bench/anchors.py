"""The programs the benchmarks measure ddplaunch against, found in the benchmark Python
environment: $DDPLAUNCH_BENCH_PYTHON, which bench/run sets to the benchmarks' venv's python
(scripts/python-env --bench: nvidia-resiliency-ext and torchft on the workers' torch 2.x).

torchrun is that torch's own `torchrun`; with Debian's /usr/bin/python3 (torch 1.13, whose
torchrun crashes on Python 3.11) it is bench/torchrun_shim.py, as before."""
import os
import subprocess

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PY = os.environ.get("DDPLAUNCH_BENCH_PYTHON") or "/usr/bin/python3"
SHIM = os.path.join(ROOT, "bench", "torchrun_shim.py")
_versions = {}


def torch_version(py=PY):
    """torch.__version__ of py, without the local part ("2.15.0")."""
    if py not in _versions:
        out = subprocess.run([py, "-c", "import torch; print(torch.__version__)"],
                             capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise SystemExit("%s cannot import torch: %s" % (py, out.stderr.strip()[-500:]))
        _versions[py] = out.stdout.strip().split("+")[0]
    return _versions[py]


def torchrun(py=PY):
    """The command line that starts torchrun of py's torch."""
    if torch_version(py).startswith("1."):
        return [py, SHIM]
    script = os.path.join(os.path.dirname(py), "torchrun")
    return [script] if os.path.exists(script) else [py, "-m", "torch.distributed.run"]


def torchrun_name(py=PY):
    return "torchrun %s" % torch_version(py)


def venv_tool(name, py=PY):
    """A console script of the benchmark environment (ft_launcher, torchft_lighthouse), or None."""
    path = os.path.join(os.path.dirname(py), name)
    return path if os.path.exists(path) else None
