"""mmpack's Spark-side code: everything the driver and the executors need.

Ships to executors as a zip (``--py-files``). One package per stage (``normalize``,
``tokenize``, ``pack``, ``validate``: each a ``stage.py`` and its building blocks), ``io``
for files, Delta tables and the run context, ``config`` for the typed configuration;
``pipeline.STAGES`` lists the stages and what each reads and writes.
"""

__version__ = "0.1.0"
