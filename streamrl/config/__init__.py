"""Typed run configuration (pydantic) and its YAML / dotted-override loader."""

from streamrl.config.loader import ConfigError, dump_yaml, load_config
from streamrl.config.schema import Config

__all__ = ["Config", "ConfigError", "dump_yaml", "load_config"]
