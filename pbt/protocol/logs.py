"""What the package's processes print: the controller's and members' own lines, not the
chatter of libraries they import.

``kernels`` (which bitsandbytes imports, and peft imports bitsandbytes) logs a warning on
import when the Hugging Face Hub is offline ("Skipping publisher trust check ..."): with no
logging configured, Python prints it on stderr, where it would be the one line a user reads
before ``pbt check``'s own, or break a log that promises one line per problem.
"""

from __future__ import annotations

import logging

QUIET_LOGGERS = ("kernels",)
"""Loggers of libraries whose warnings are not the user's concern; their errors still print."""


def quiet_library_loggers() -> None:
    """Raise :data:`QUIET_LOGGERS` to ``ERROR`` (call first thing in an entry point)."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
