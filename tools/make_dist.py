"""Build dist/mmpack_udfs.zip: the executor code for ``spark-submit --py-files``.

    python tools/make_dist.py [DIST_DIR]

The zip holds the ``mmpack_udfs`` and ``loader`` packages (sources only; the pack report
and ``balance-report`` plan epochs with ``loader.balance``, which needs no torch), without
``mmpack_udfs/demo`` (the demo data generator never runs under spark-submit). The config
defaults are the model's (``mmpack_udfs/config/model.py``), so no data file ships. Entries
are sorted and time-stamped 1980-01-01, so the same sources give the same bytes.
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DRIVER_ONLY = ROOT / "mmpack_udfs" / "demo"  # left out of the zip


def build(dist: Path) -> Path:
    dist.mkdir(parents=True, exist_ok=True)
    target = dist / "mmpack_udfs.zip"
    files = sorted(
        p
        for package in ("mmpack_udfs", "loader")
        for p in (ROOT / package).rglob("*.py")
        if "__pycache__" not in p.parts and p.parent != DRIVER_ONLY
    )
    entries = [(p, p.relative_to(ROOT).as_posix()) for p in files]
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as archive:
        for path, name in entries:
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, path.read_bytes())
    return target


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "dist"))
