"""Storage and Spark plumbing every stage shares.

Files (local or S3), Delta tables, the output lock, the SparkSession, run bookkeeping.
"""
