"""The mmpack command line: options, help and exit codes (no Spark needed for these)."""

import pytest

from mmpack_udfs import cli


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert all(c in out for c in ("normalize", "tokenize", "pack", "report", "demo-data"))


def test_bad_config_exits_2_with_a_message(capsys, tmp_path):
    code = cli.main(["normalize", "--set", "normalize.nope=1", "--out", str(tmp_path)])
    assert code == cli.EXIT_BAD_CONFIG
    assert "unknown config key 'normalize.nope'" in capsys.readouterr().err


def test_no_datasets_exits_2(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("mmpack_udfs.spark.get_spark", lambda *a, **k: None)
    assert cli.main(["normalize", "--out", str(tmp_path)]) == cli.EXIT_BAD_CONFIG
    assert "no datasets configured" in capsys.readouterr().err


def test_missing_input_exits_1(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("mmpack_udfs.spark.get_spark", lambda *a, **k: None)
    dataset = f"datasets=[{{name: a, paths: [{tmp_path}/none/*.jsonl], media_root: {tmp_path}}}]"
    assert cli.main(["normalize", "--out", str(tmp_path), "--set", dataset]) == cli.EXIT_FAILED
    assert "no input files match" in capsys.readouterr().err


def test_demo_data_command(tmp_path, capsys):
    assert cli.main(["demo-data", str(tmp_path / "d"), "--samples", "10", "--seed", "1"]) == 0
    assert (tmp_path / "d" / "mmpack.yaml").exists()
    assert "records" in capsys.readouterr().out
