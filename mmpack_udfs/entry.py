"""The ``mmpack`` console script. The pipeline needs the ``spark`` extra; a training-only
install (``mmpack[train]``) has the loader and not the pipeline, and is told so plainly."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

SPARK_SIDE = ("pyspark", "deltalake", "yaml", "transformers", "numba")


def main(argv: Sequence[str] | None = None) -> int:
    missing = [name for name in SPARK_SIDE if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"mmpack: the pipeline needs the 'spark' extra (missing: {', '.join(missing)}): "
            "pip install 'mmpack[spark]'. The training side (import loader) needs only 'mmpack[train]'.",
            file=sys.stderr,
        )
        return 2
    from mmpack_udfs.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
