"""The mmpack command line: options, help and exit codes (no Spark needed for these)."""

import json

import pytest
import yaml

from mmpack_udfs import cli


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert all(c in out for c in ("normalize", "tokenize", "pack", "report", "demo-data", "export"))


def test_export_energon_without_a_published_pack_exits_2_before_spark(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("mmpack_udfs.io.spark.get_spark", lambda *a, **k: pytest.fail("Spark started"))
    args = ["export", "energon", "--out", str(tmp_path), "--to", str(tmp_path / "energon")]
    assert cli.main(args) == cli.EXIT_BAD_CONFIG
    assert "no manifest at" in capsys.readouterr().err and not (tmp_path / "energon").exists()
    with pytest.raises(SystemExit):
        cli.main(["export", "energon", "--out", str(tmp_path)])
    assert "the following arguments are required: --to" in capsys.readouterr().err


def test_export_rl_without_tokenized_tables_exits_2_before_spark(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("mmpack_udfs.io.spark.get_spark", lambda *a, **k: pytest.fail("Spark started"))
    args = ["export", "rl", "--out", str(tmp_path), "--to", str(tmp_path / "rl")]
    assert cli.main([*args, "--max-prompt-length", "512"]) == cli.EXIT_BAD_CONFIG
    assert "no tokenized table" in capsys.readouterr().err and not (tmp_path / "rl").exists()
    with pytest.raises(SystemExit):
        cli.main(args)
    assert "the following arguments are required: --max-prompt-length" in capsys.readouterr().err


def test_bad_config_exits_2_with_a_message(capsys, tmp_path):
    code = cli.main(["normalize", "--set", "normalize.nope=1", "--out", str(tmp_path)])
    assert code == cli.EXIT_BAD_CONFIG
    assert "unknown config key 'normalize.nope'" in capsys.readouterr().err


def test_no_datasets_exits_2(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("mmpack_udfs.io.spark.get_spark", lambda *a, **k: None)
    assert cli.main(["normalize", "--out", str(tmp_path)]) == cli.EXIT_BAD_CONFIG
    assert "datasets: none configured" in capsys.readouterr().err


def test_missing_input_exits_1(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("mmpack_udfs.io.spark.get_spark", lambda *a, **k: None)
    dataset = f"datasets=[{{name: a, paths: [{tmp_path}/none/*.jsonl], media_root: {tmp_path}}}]"
    args = ["normalize", "--out", str(tmp_path), "--set", dataset, "--set", "spark.progress_seconds=0"]
    assert cli.main(args) == cli.EXIT_FAILED
    assert "no input files match" in capsys.readouterr().err


def test_out_is_required_and_options_are_offered_only_where_they_act(capsys):
    with pytest.raises(SystemExit):
        cli.main(["pack"])
    assert "the following arguments are required: --out" in capsys.readouterr().err
    parser = cli.build_parser()
    commands = parser._subparsers._group_actions[0].choices
    offered = {name: {o for a in p._actions for o in a.option_strings} for name, p in commands.items()}
    assert {"--run-id", "--mode"} <= offered["normalize"] and {"--run-id", "--mode"} <= offered["run"]
    assert "--run-id" in offered["pack"] and "--mode" not in offered["pack"]
    assert not {"--run-id", "--mode"} & offered["validate"]
    assert not {"--run-id", "--mode", "--master"} & (offered["gc"] | offered["report"])
    assert "--config" not in offered["demo"]  # the demo writes its own
    assert all("--out" in offered[c] for c in ("run", "normalize", "report", "gc", "demo", "balance-report"))
    assert "reads OUT/tables/tokenized; writes OUT/packed/shards" in commands["pack"].format_help()


def test_demo_data_command(tmp_path, capsys):
    assert cli.main(["demo-data", str(tmp_path / "d"), "--samples", "10", "--seed", "1"]) == 0
    assert (tmp_path / "d" / "mmpack.yaml").exists()
    assert "records" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("setting", "key"),
    [
        ("s3.retries=many", "s3.retries"),
        ("s3.scheme=ftp", "s3.scheme"),
        ("s3.connect_timeout=-1", "s3.connect_timeout"),
        ("spark.conf.spark.executor.memory=[4g]", "spark.conf.spark.executor.memory"),
        ("spark.log_level=LOUD", "spark.log_level"),
        ("tokenize.tokenizer=/no/such/tokenizer", "tokenize.tokenizer"),
    ],
)
def test_bad_values_exit_2_naming_the_key(capsys, tmp_path, setting, key):
    assert cli.main(["pack", "--out", str(tmp_path), "--set", setting]) == cli.EXIT_BAD_CONFIG
    err = capsys.readouterr().err
    assert f"configuration error: {key}" in err and "Traceback" not in err


def test_an_unexpected_failure_is_one_line_and_verbose_shows_the_traceback(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    target = str(blocker / "demo")  # a real fault: the directory cannot be created
    assert cli.main(["demo-data", target, "--samples", "5"]) == cli.EXIT_FAILED
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("mmpack: NotADirectoryError: ") and "--verbose" in lines[-1]
    assert len(lines) == 2
    with pytest.raises(NotADirectoryError):
        cli.main(["demo-data", target, "--samples", "5", "--verbose"])


def test_operational_failures_say_what_to_do(tmp_path):
    import errno
    import os

    import pyarrow.parquet as pq

    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "part-0.parquet"))
    assert "free space" in cli.operational_failure(full)
    (tmp_path / "x.parquet").write_bytes(b"definitely not parquet")
    with pytest.raises(Exception) as corrupt:
        pq.read_table(tmp_path / "x.parquet")
    assert "not Parquet" in cli.operational_failure(corrupt.value)
    spark_style = RuntimeError(
        "An error occurred in a task.\nTraceback (most recent call last):\n  ...\nKeyError: 'x'"
    )
    assert cli.operational_failure(spark_style) == "KeyError: 'x'"


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 16 KiB filesystem (tmpfs), so that writing fills it: ENOSPC for real."""
    import subprocess

    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_is_one_line_that_says_so(tiny_disk, capsys):
    assert cli.main(["demo-data", str(tiny_disk / "demo"), "--samples", "50"]) == cli.EXIT_FAILED
    lines = capsys.readouterr().err.strip().splitlines()
    assert "No space left on device" in lines[0] and "free space on that disk" in lines[0]
    assert len(lines) == 2 and "Traceback" not in lines[0]


def test_a_missing_s3_bucket_is_one_line_that_says_what_to_check(s3_server, capsys):
    s3 = [
        "--set",
        f"s3.endpoint_override={s3_server}",
        "--set",
        "s3.scheme=http",
        "--set",
        "s3.region=us-east-1",
    ]
    assert cli.main(["gc", "--out", "s3://no-such-bucket-here/run", *s3]) == cli.EXIT_FAILED
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and "check the bucket name" in lines[0], lines


def test_numbers_given_as_text_are_read_as_the_keys_type():
    from mmpack_udfs.config import load_config

    config = load_config(None, ["normalize.max_image_pixels=1e8", "normalize.split_bytes=6.4e7"])
    assert config.normalize.max_image_pixels == 100_000_000
    assert isinstance(config.normalize.max_image_pixels, int)
    assert config.normalize.split_bytes == 64_000_000


def test_a_wrong_type_names_the_key(capsys, tmp_path):
    assert cli.main(["pack", "--out", str(tmp_path), "--set", "pack.bins_per_shard=1.5"]) == 2
    assert "pack.bins_per_shard must be a positive integer" in capsys.readouterr().err


def test_a_tokenizer_without_the_profiles_chat_tokens_exits_2_before_spark(capsys, tmp_path, monkeypatch):
    from tokenizers import Tokenizer, models, pre_tokenizers

    plain = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    plain.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path / "plain-tokenizer"
    folder.mkdir()
    plain.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')

    def no_spark(*args, **kwargs):
        raise AssertionError("Spark must not start")

    monkeypatch.setattr("mmpack_udfs.io.spark.get_spark", no_spark)
    code = cli.main(["tokenize", "--out", str(tmp_path / "out"), "--set", f"tokenize.tokenizer={folder}"])
    assert code == cli.EXIT_BAD_CONFIG
    err = capsys.readouterr().err
    assert "tokenize.tokenizer" in err and "<|im_start|>" in err and "profile 'qwen2_vl'" in err


def test_config_prints_the_checked_configuration_with_help(capsys):
    assert cli.main(["config", "--set", "pack.budget=1e4"]) == cli.EXIT_OK
    printed = capsys.readouterr().out
    assert "  budget: 10000" in printed and "# tokens per bin" in printed
    assert cli.main(["config", "--keys"]) == cli.EXIT_OK
    assert "normalize.max_image_pixels = 89478485" in capsys.readouterr().out
    assert cli.main(["config", "--set", "pack.budgt=3"]) == cli.EXIT_BAD_CONFIG
    assert "unknown config key 'pack.budgt'" in capsys.readouterr().err


def no_spark(*args, **kwargs):
    raise AssertionError("Spark must not start")


@pytest.mark.parametrize(
    ("dataset", "says"),
    [
        (
            {"columns": {"audio": "a"}},
            "unknown config key 'datasets[0].columns.audio' (valid here: messages,",
        ),
        (
            {"tags": {"speaker_tag": "s"}},
            "unknown config key 'datasets[0].tags.speaker_tag' (valid here: role_key,",
        ),
        ({"tags": {"user_tag": 3}}, "datasets[0].tags.user_tag must be a role tag"),
    ],
)
def test_unknown_mapping_keys_exit_2_before_spark_naming_the_key(
    capsys, tmp_path, monkeypatch, dataset, says
):
    monkeypatch.setattr("mmpack_udfs.io.spark.get_spark", no_spark)
    config = tmp_path / "c.yaml"
    config.write_text(
        yaml.safe_dump({"datasets": [{"name": "d", "paths": "x.jsonl", "media_root": ".", **dataset}]})
    )
    assert (
        cli.main(["normalize", "--config", str(config), "--out", str(tmp_path / "o")]) == cli.EXIT_BAD_CONFIG
    )
    assert says in capsys.readouterr().err


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ({"hf_hub_url": "someone/x"}, "has no file_name (hf_hub_url): mmpack reads files"),
        ({"file_name": "a.json", "formatting": "sharegpt", "columns": {"tools": "tools"}}, "column(s) tools"),
        ({"file_name": "a.json", "num_samples": 10}, "does not support num_samples"),
        ({"file_name": "a.json", "formatting": "kto"}, "formatting 'kto'"),
        ({"file_name": "a.json", "tags": {"role_tag": "r", "speaker": "s"}}, "unknown config key 'speaker'"),
    ],
)
def test_dataset_info_entries_mmpack_cannot_read_exit_2_naming_them(
    capsys, tmp_path, monkeypatch, entry, says
):
    monkeypatch.setattr("mmpack_udfs.io.spark.get_spark", no_spark)
    (tmp_path / "dataset_info.json").write_text(json.dumps({"mine": entry, "other": {"file_name": "o.json"}}))
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"datasets": [{"name": "lf", "dataset_info": ".", "names": ["mine"]}]}))
    assert cli.main(["run", "--config", str(config), "--out", str(tmp_path / "o")]) == cli.EXIT_BAD_CONFIG
    err = capsys.readouterr().err
    assert "dataset_info entry 'mine'" in err and says in err
    config.write_text(yaml.safe_dump({"datasets": [{"name": "lf", "dataset_info": ".", "names": ["nope"]}]}))
    assert (
        cli.main(["normalize", "--config", str(config), "--out", str(tmp_path / "o")]) == cli.EXIT_BAD_CONFIG
    )
    assert "has no entry nope (it has: mine, other)" in capsys.readouterr().err


def test_preference_and_sft_datasets_in_one_run_exit_2(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("mmpack_udfs.io.spark.get_spark", no_spark)
    info = {"pairs": {"file_name": "r.json", "ranking": True}, "sft": {"file_name": "s.json"}}
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    config = tmp_path / "c.yaml"
    config.write_text(
        yaml.safe_dump({"datasets": [{"name": "lf", "dataset_info": ".", "names": ["pairs", "sft"]}]})
    )
    assert cli.main(["run", "--config", str(config), "--out", str(tmp_path / "o")]) == cli.EXIT_BAD_CONFIG
    err = capsys.readouterr().err
    assert "lf/pairs hold preference pairs (ranking: true) and lf/sft SFT conversations" in err
