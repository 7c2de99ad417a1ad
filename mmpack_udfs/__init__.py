"""mmpack's Spark-side code: everything the driver and the executors need.

Ships to executors as a zip (``--py-files``). Stages live in ``mmpack_udfs.stages``;
the pure building blocks (parsing, media probing, table I/O) sit beside them.
"""

__version__ = "0.1.0"
