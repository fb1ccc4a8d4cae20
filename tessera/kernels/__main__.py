import sys

from tessera.kernels.library import main

sys.exit(main(sys.argv))
