"""The trainer's configuration schema moved to `runcontract.config` (torch-free, so that rlmctl
validates a config without torch); these names stay importable from here."""

from __future__ import annotations

from runcontract.config import PRESETS as PRESETS
from runcontract.config import CheckpointConfig as CheckpointConfig
from runcontract.config import CommConfig as CommConfig
from runcontract.config import Config as Config
from runcontract.config import DataConfig as DataConfig
from runcontract.config import EvalConfig as EvalConfig
from runcontract.config import MetricsConfig as MetricsConfig
from runcontract.config import ModelConfig as ModelConfig
from runcontract.config import OptimConfig as OptimConfig
from runcontract.config import ParallelConfig as ParallelConfig
from runcontract.config import TrainConfig as TrainConfig
from runcontract.config import check_world_size as check_world_size
from runcontract.config import dump_yaml as dump_yaml
from runcontract.config import from_dict as from_dict
from runcontract.config import load_config as load_config
from runcontract.config import model_config as model_config
from runcontract.config import parse_override as parse_override
from runcontract.config import to_dict as to_dict
from runcontract.config import valid_keys as valid_keys
from runcontract.config import validate as validate
