"""``python -m pbt.cli``: the ``pbt`` command."""

import sys

from pbt.cli.main import main

sys.exit(main())
