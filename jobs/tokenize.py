"""spark-submit application for the tokenize stage.

    spark-submit --py-files dist/mmpack_udfs.zip jobs/tokenize.py --config my.yaml --out OUT

Takes the same options as ``mmpack tokenize``; exit code 0 on success, 1 on a failed
run (missing input, reconciliation), 2 on a configuration error.
"""

import sys

from mmpack_udfs.cli import main

if __name__ == "__main__":
    sys.exit(main(["tokenize", *sys.argv[1:]]))
