"""`python -m ddplaunch ARGS` runs the ddplaunch program that the wheel installed with this
package (docs/install.md, "pip"), as `python -m torch.distributed.run` runs torchrun."""

import os
import sys


def main():
    program = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "ddplaunch")
    if not os.access(program, os.X_OK):
        sys.stderr.write("ddplaunch: this copy of the Python package (%s) came without the ddplaunch program; "
                         "install the wheel (pip install ddplaunch) or run the one a source build made "
                         "(build/bin/ddplaunch)\n" % os.path.dirname(program))
        return 2
    os.execv(program, ["ddplaunch"] + sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
