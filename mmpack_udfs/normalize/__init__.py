"""Stage 1: input files and their media → Delta ``samples`` + ``quarantine``.

Reads ShareGPT / OpenAI records from JSON, JSONL or Parquet; probes every image and video.
"""
