"""`python -m tercomp ...` is the `tercomp` command."""
import sys

from .cli import main

sys.exit(main())
