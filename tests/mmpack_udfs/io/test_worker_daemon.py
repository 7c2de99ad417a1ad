import pyarrow as pa
import pytest

from mmpack_udfs.io.worker_daemon import without_packaged_zip


def _package(root, name="site"):
    """A pyspark package under ``root/name`` with its own pyspark.zip, as pip installs it."""
    package = root / name / "pyspark"
    (package / "python" / "lib").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    zipped = package / "python" / "lib" / "pyspark.zip"
    zipped.write_bytes(b"")
    return str(root / name), str(zipped)


def test_the_zip_inside_the_installed_package_leaves_the_path(tmp_path):
    site, zipped = _package(tmp_path)
    other = str(tmp_path / "lib" / "py4j-src.zip")
    assert without_packaged_zip([zipped, other, site]) == [other, site]


def test_a_zip_of_another_spark_home_stays(tmp_path):
    site, _ = _package(tmp_path)
    _, foreign = _package(tmp_path, "spark-home")  # not the package on the path
    assert without_packaged_zip([foreign, site]) == [foreign, site]
    assert without_packaged_zip([foreign]) == [foreign]  # no package: the zip is all there is


@pytest.mark.spark
def test_a_local_sessions_workers_import_pyspark_from_the_package(spark):
    def origin(batches):
        import pyspark

        for _ in batches:
            yield pa.RecordBatch.from_pydict({"file": [pyspark.__file__]})

    files = spark.range(1).mapInArrow(origin, "file string").toArrow().column("file").to_pylist()
    assert files and ".zip" not in files[0]
