"""spark-submit application for the tokenize stage.

    spark-submit --py-files dist/mmpack_udfs.zip jobs/tokenize.py --config my.yaml --out OUT

Takes the same options as ``mmpack tokenize``; exit code 0 on success, 1 on a failed
run (missing input, reconciliation), 2 on a configuration error.
"""

import os
import sys

# This folder holds tokenize.py, which would shadow the standard library's tokenize module
# for everything the job imports: take the folder off the import path first.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]

from mmpack_udfs.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["tokenize", *sys.argv[1:]]))
