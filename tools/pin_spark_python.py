"""Make a virtualenv's ``bin/spark-submit`` run with that virtualenv's Python by default.

pyspark's launcher finds Python on PATH (``python3``), so ``.venv/bin/spark-submit`` called
by absolute path (cron, an Airflow worker, an IDE) without the venv on PATH cannot find
SPARK_HOME and exits 127. This inserts two defaults after the shebang; PYSPARK_PYTHON and
PYSPARK_DRIVER_PYTHON set by the caller still win. Idempotent: ``make setup`` runs it.

    python tools/pin_spark_python.py .venv
"""

from __future__ import annotations

import sys
from pathlib import Path

MARKER = "# mmpack: default to this virtualenv's Python"
DEFAULTS = f"""{MARKER} (runnable by absolute path, without the venv on PATH)
export PYSPARK_PYTHON="${{PYSPARK_PYTHON:-$(cd "$(dirname "$0")"; pwd)/python}}"
export PYSPARK_DRIVER_PYTHON="${{PYSPARK_DRIVER_PYTHON:-$PYSPARK_PYTHON}}"
"""


def pin(venv: Path) -> bool:
    """Patch ``venv/bin/spark-submit``; False when it was patched already."""
    script = venv / "bin" / "spark-submit"
    text = script.read_text()
    if MARKER in text:
        return False
    shebang, _, rest = text.partition("\n")
    script.write_text(f"{shebang}\n{DEFAULTS}{rest}")
    return True


if __name__ == "__main__":
    pin(Path(sys.argv[1]))
