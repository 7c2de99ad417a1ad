"""Exports of a published pack into the formats other trainers read (``mmpack export``)."""
