"""Reports over an output root (driver only, never shipped to executors).

The packing report (text, JSON, plots) and the data-parallel balance report.
"""
