"""Build dist/mmpack_udfs.zip: the executor code for ``spark-submit --py-files``.

    python tools/make_dist.py [DIST_DIR]

The zip holds the ``mmpack_udfs`` and ``loader`` packages (sources only; the pack report
and ``balance-report`` plan epochs with ``loader.balance``, which needs no torch) and
the config defaults as
``mmpack_udfs/conf/defaults.yaml`` (config.py reads them from there when the package is
imported from the zip). Entries are sorted and time-stamped 1980-01-01, so the same
sources give the same bytes.
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build(dist: Path) -> Path:
    dist.mkdir(parents=True, exist_ok=True)
    target = dist / "mmpack_udfs.zip"
    files = sorted(
        p
        for package in ("mmpack_udfs", "loader")
        for p in (ROOT / package).rglob("*.py")
        if "__pycache__" not in p.parts
    )
    entries = [(p, p.relative_to(ROOT).as_posix()) for p in files]
    entries.append((ROOT / "conf" / "defaults.yaml", "mmpack_udfs/conf/defaults.yaml"))
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as archive:
        for path, name in entries:
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, path.read_bytes())
    return target


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "dist"))
