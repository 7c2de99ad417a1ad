"""Stage 3: Delta ``tokenized`` → packed Parquet shards, their cost index and the manifest.

First-fit-decreasing over token lengths; bins written in cost-stratified order.
"""
