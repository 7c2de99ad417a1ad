"""Configuration: one typed model (``model.Config``) is the source of every key; ``load_config``
reads the defaults, a --config file and --set overrides into it."""

from mmpack_udfs.config.loading import config_hash, load_config
from mmpack_udfs.config.model import Config
from mmpack_udfs.errors import ConfigError

__all__ = ["Config", "ConfigError", "config_hash", "load_config"]
