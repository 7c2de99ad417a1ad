"""The run context: what every stage of one run shares, resolved once from the config."""

from __future__ import annotations

from dataclasses import dataclass

from mmpack_udfs import schemas
from mmpack_udfs.config import Config
from mmpack_udfs.io import fs


@dataclass(frozen=True)
class RunContext:
    """One run: its checked config, its output root and how to reach its files.

    Built once per command (``RunContext.of(config)``) and handed to every stage, instead of
    each stage re-reading the output root and S3 settings from the config.
    """

    config: Config
    output: str  # absolute local path or s3:// URI, no trailing slash
    storage: fs.Storage  # every file and Delta access of the run

    @classmethod
    def of(cls, config: Config) -> RunContext:
        return cls(config, fs.normalize_uri(config.output), fs.Storage(fs.S3Options.from_config(config.s3)))

    @property
    def run_id(self) -> str | None:
        """The configured run id; None: each stage derives one from its inputs."""
        return self.config.run_id

    @property
    def mode(self) -> str:
        return self.config.mode

    def table(self, name: str) -> str:
        """The URI of one of the run's Delta tables (``schemas.TABLES``)."""
        return schemas.table_uri(self.output, name)

    def report(self, name: str) -> str:
        return schemas.report_uri(self.output, name)

    @property
    def packed(self) -> str:
        return schemas.packed_uri(self.output)
