"""`python -m tessera` runs the same command line as the `tessera` script."""
import sys

from tessera.cli import main

if __name__ == "__main__":  # not when an engine-core process (spawn) re-imports this module
    sys.exit(main())
