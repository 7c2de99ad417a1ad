"""Training-side package: reads packed shards. Never imports pyspark."""
