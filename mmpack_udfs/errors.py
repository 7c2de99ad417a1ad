"""One error model: every failure mmpack reports to a user derives from ``MmpackError``,
whose ``exit_code`` the CLI (and so every spark-submit job) exits with.

    0  success
    1  the run failed (bad input, over budget, a check that did not hold, a held lock)
    2  the configuration is wrong (named key, before Spark starts)

Anything else is unexpected: the CLI prints one line and a hint (``--verbose`` for the
traceback) and exits 1.
"""

from __future__ import annotations

EXIT_OK, EXIT_FAILED, EXIT_BAD_CONFIG = 0, 1, 2


class MmpackError(Exception):
    """A failure with a message written for the user; ``exit_code`` says which kind."""

    exit_code = EXIT_FAILED


class ConfigError(MmpackError, ValueError):
    """A configuration problem a user can fix; the message says what and where."""

    exit_code = EXIT_BAD_CONFIG


class ReconciliationError(MmpackError, RuntimeError):
    """Rows in != rows out + rows quarantined: a stage refuses to commit what it cannot account for."""
