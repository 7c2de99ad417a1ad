"""The spark-submit application of every mmpack stage: the stage is the first argument.

    spark-submit --py-files dist/mmpack_udfs.zip jobs/mmpack_job.py pack --config my.yaml --out OUT

Takes the same arguments as the ``mmpack`` command (normalize, tokenize, pack, validate,
run, ...); exits with the CLI's code: 0 on success, 1 on a failed run (missing input,
samples over the budget, reconciliation), 2 on a configuration error.
"""

import os
import sys

# Take this folder off the import path: a file here must never shadow a standard-library
# module (a jobs/tokenize.py once shadowed ``tokenize`` for everything the job imported).
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]

from mmpack_udfs.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
