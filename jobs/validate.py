"""spark-submit application for the validate stage (the DAG's validate-shards task).

    spark-submit --py-files dist/mmpack_udfs.zip jobs/validate.py --config my.yaml --out OUT

Takes the same options as ``mmpack validate``; exit code 0 when the packing is valid, 1 on
problems (listed; all in OUT/report/validate.json), 2 on a configuration error.
"""

import os
import sys

# This folder holds tokenize.py, which would shadow the standard library's tokenize module
# for everything the job imports: take the folder off the import path first.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]

from mmpack_udfs.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["validate", *sys.argv[1:]]))
