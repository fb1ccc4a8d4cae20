"""`python -m tessera` runs the same command line as the `tessera` script."""
import sys

from tessera.cli import main

sys.exit(main())
