"""`python -m tercomp.cli ...` is the `tercomp` command."""
import sys

from . import main

sys.exit(main())
