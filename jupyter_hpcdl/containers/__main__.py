import sys

from .quickstart import main

sys.exit(main())
