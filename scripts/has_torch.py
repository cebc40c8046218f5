"""Exit 0 when an importable torch >= 2.5 is present, 1 otherwise (the Makefile then installs one)."""

import sys

try:
    import torch
except ImportError:
    sys.exit(1)

major, minor = (int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 5) else 1)
