"""The job's configuration, read by the trainer, the planner and the benchmark alike.

- :mod:`.reader`: a TOML file and ``--section.key value`` overrides -> dataclasses, every
  value type-checked, every error naming its key; ``--help`` from the fields' docs.
- :mod:`.job`: the trainer's sections (``JobConfig``), their defaults and range checks.

Errors (``ConfigError``) live in :mod:`simplefsdp.errors`, below every layer.
"""

from ..errors import ConfigError
from .job import JobConfig, ParallelConfig, config_help, load_config, parse_args

__all__ = ["ConfigError", "JobConfig", "ParallelConfig", "config_help", "load_config",
           "parse_args"]
