"""Stage 4: check a published pack (every shard against the manifest, every sample exactly once)."""
