"""`python -m fastgen.launch` is `fastgen-deploy`."""

import sys

from .cli import main

sys.exit(main())
