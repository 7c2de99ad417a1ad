"""The run context: what every stage of one run shares, resolved once where the run starts
(``mmpack_udfs.resolve.load_run``): the config, the output root, the storage and the model
directory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmpack_udfs import schemas
from mmpack_udfs.config import Config
from mmpack_udfs.families.model_dir import ModelDirectory
from mmpack_udfs.io import fs


@dataclass(frozen=True)
class RunContext:
    """One run: its checked config, its output root, how to reach its files, and the model
    directory of ``tokenize.model`` as it was read once.

    Built once per command and handed to every stage, instead of each stage re-reading the
    output root, the S3 settings or the model directory.
    """

    config: Config
    output: str  # absolute local path or s3:// URI, no trailing slash
    storage: fs.Storage  # every file and Delta access of the run
    model: ModelDirectory | None = None  # tokenize.model, resolved (None without one)

    @classmethod
    def of(cls, config: Config, model: ModelDirectory | None = None) -> RunContext:
        """The context of a checked config; with ``tokenize.model`` set, ``model`` is that
        directory as the run start resolved it (``resolve.load_run`` builds both)."""
        if (config.tokenize.model is None) != (model is None):
            raise ValueError("a run with tokenize.model needs its resolved ModelDirectory (resolve.load_run)")
        return cls(
            config, fs.normalize_uri(config.output), fs.Storage(fs.S3Options.from_config(config.s3)), model
        )

    def with_config(self, config: Config) -> RunContext:
        """This run with another checked config (the same model directory)."""
        return RunContext.of(config, self.model)

    def model_record(self) -> dict[str, Any] | None:
        """What the run summary and the manifest record of ``tokenize.model`` (None without
        one): its source, model type, family, the notes of its resolution and the chat
        renderer the run uses."""
        if self.model is None:
            return None
        return {**self.model.record(), "chat": self.config.profile.chat}

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
