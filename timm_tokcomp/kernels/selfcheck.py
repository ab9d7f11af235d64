"""`python -m timm_tokcomp.kernels.selfcheck`: the name the shared GPU kit (`../shared/gpu/measure.sh`, part 1)
runs the kernel check by; it is `python -m timm_tokcomp.selfcheck` (same arguments)."""
import sys

from ..selfcheck import main

if __name__ == "__main__":
    sys.exit(main())
