#!/usr/bin/python3
"""Runs Debian's torchrun 1.13 on Python 3.11, for the benchmarks.

torch 1.13's Std.from_str("0") returns None on Python 3.11: since 3.11, iterating an IntFlag no
longer yields its zero member (Std.NONE), so torchrun's default --redirects=0/--tee=0 crash it.
This shim maps None (and None values of per-rank maps) to Std.NONE, then runs torchrun's main.
Usage: /usr/bin/python3 bench/torchrun_shim.py [torchrun arguments...]
"""

import sys

from torch.distributed.elastic.multiprocessing import api as mp_api

_original_from_str = mp_api.Std.from_str


def _from_str(vm):
    value = _original_from_str(vm)
    if value is None:
        return mp_api.Std.NONE
    if isinstance(value, dict):
        return {k: (mp_api.Std.NONE if v is None else v) for k, v in value.items()}
    return value


mp_api.Std.from_str = staticmethod(_from_str)

if __name__ == "__main__":
    from torch.distributed import run

    sys.argv[0] = "torchrun"
    sys.exit(run.main())
