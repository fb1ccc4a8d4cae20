import sys

from tessera.kernels import main

sys.exit(main(sys.argv))
