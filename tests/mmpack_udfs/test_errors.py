"""One error model: every failure a user sees is an MmpackError carrying its exit code."""

from __future__ import annotations

import pytest

from loader.source import ShardError
from mmpack_udfs import cli, errors, schemas
from mmpack_udfs.io import lock, tables
from mmpack_udfs.normalize import inputs
from mmpack_udfs.normalize import stage as normalize
from mmpack_udfs.pack import stage as pack
from mmpack_udfs.report import pack_report as report
from mmpack_udfs.tokenize import stage as tokenize
from mmpack_udfs.validate import stage as validate


@pytest.mark.parametrize(
    "error",
    [
        lock.OutputLockedError,
        inputs.InputError,
        tables.TableError,
        report.ReportError,
        schemas.ManifestError,
        pack.PackError,
        validate.ValidationError,
        normalize.ReconciliationError,
        ShardError,
    ],
)
def test_every_run_failure_exits_1(error):
    assert issubclass(error, errors.MmpackError) and error.exit_code == cli.EXIT_FAILED == 1


def test_a_configuration_error_exits_2_and_there_is_one_reconciliation_error():
    assert errors.ConfigError.exit_code == cli.EXIT_BAD_CONFIG == 2
    assert normalize.ReconciliationError is tokenize.ReconciliationError is errors.ReconciliationError


def test_the_cli_exits_with_the_errors_code(monkeypatch, capsys):
    class Custom(errors.MmpackError):
        exit_code = 7

    def fail(args):
        raise Custom("what went wrong, in one line")

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    parser._subparsers._group_actions[0].choices["report"].set_defaults(func=fail)
    assert cli.main(["report", "--out", "somewhere"]) == 7
    assert capsys.readouterr().err.strip() == "mmpack: what went wrong, in one line"
