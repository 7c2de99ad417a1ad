"""spark-submit application for the pack stage.

    spark-submit --py-files dist/mmpack_udfs.zip jobs/pack.py --config my.yaml --out OUT

Takes the same options as ``mmpack pack``; exit code 0 on success, 1 on a failed
run (missing input, samples over the budget, reconciliation), 2 on a configuration error.
"""

import sys

from mmpack_udfs.cli import main

if __name__ == "__main__":
    sys.exit(main(["pack", *sys.argv[1:]]))
