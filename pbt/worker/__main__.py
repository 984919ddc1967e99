"""``python -m pbt.worker TASK_JSON`` or ``--serve FOLDER``: see :mod:`pbt.worker`."""

import sys

from pbt.worker.main import main

sys.exit(main())
