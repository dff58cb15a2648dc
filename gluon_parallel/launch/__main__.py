"""``python -m gluon_parallel.launch``."""
import sys

from .cli import main

sys.exit(main())
