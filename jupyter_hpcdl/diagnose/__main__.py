"""``python -m jupyter_hpcdl.diagnose``."""
import sys

from . import main

sys.exit(main())
