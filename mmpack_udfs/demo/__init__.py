"""The demo dataset (driver only): realistic records with real images and videos.

Some records are deliberately bad, so every quarantine path is exercised.
"""
