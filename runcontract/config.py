"""The trainer's configuration: typed dataclasses filled from a YAML file and `key=value` overrides.

    run_dir: runs/demo          top level: run_dir, seed
    model: {preset: tiny, d_model: 128}     ModelConfig: a preset plus field overrides
    data: {path: data/demo}                  DataConfig
    checkpoint: {interval_steps: 100}        CheckpointConfig
    train / optim / eval / comm / parallel / metrics

Every value is coerced to its field's declared type (overrides arrive as strings), unknown keys are
a ConfigError naming the closest valid key, and `validate` rejects impossible values before any
process group, model or data is touched. docs/trainer.md is the reference of every key.

Part of the run contract, torch-free: rlmctl validates a config with this very parser before it
launches (and plans its memory from `ModelConfig`); the trainer's modules import their sections
from here.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

import yaml

from runcontract.errors import ConfigError

# Annotations are strings under `from __future__ import annotations`; bool is checked apart
# because isinstance(True, int) holds.
_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {"int": int, "float": (int, float), "bool": bool}


@dataclass
class ModelConfig:
    vocab_size: int
    d_model: int
    n_heads: int
    mlp_hidden: int
    n_prelude: int
    n_core: int
    n_coda: int
    max_seq_len: int
    rope_base: float = 50000.0
    mean_recurrence: int = 32
    recurrence_sigma: float = 0.5
    backprop_depth: int = 8
    norm_eps: float = 1e-6
    activation_checkpointing: bool = False
    compile: bool = False

    def __post_init__(self) -> None:
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def effective_depth(self) -> int:
        """Blocks executed per token at the mean depth; scales the output-projection init."""
        return self.n_prelude + self.n_coda + self.n_core * self.mean_recurrence

    def validate(self) -> None:
        """Raise ConfigError with one line naming the first invalid field."""
        for f in fields(self):
            value = getattr(self, f.name)
            wanted = _FIELD_TYPES[str(f.type)]
            if isinstance(value, bool) is not (f.type == "bool") or not isinstance(value, wanted):
                raise ConfigError(f"model.{f.name} must be {f.type}, got {value!r}")
        positive: tuple[str, ...] = ("vocab_size", "d_model", "n_heads", "mlp_hidden", "n_core")
        positive += ("max_seq_len", "mean_recurrence", "rope_base", "norm_eps")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name} must be > 0, got {getattr(self, name)}")
        for name in ("n_prelude", "n_coda", "backprop_depth", "recurrence_sigma"):
            if getattr(self, name) < 0:
                raise ConfigError(f"model.{name} must be >= 0, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"model.n_heads={self.n_heads} must divide model.d_model={self.d_model}"
            )
        if self.head_dim % 2:
            raise ConfigError(
                f"head dim d_model/n_heads = {self.head_dim} must be even for RoPE; "
                "change model.d_model or model.n_heads"
            )


# fmt: off
PRESETS: dict[str, ModelConfig] = {
    # CPU unit tests: a forward+backward takes milliseconds.
    "tiny": ModelConfig(
        vocab_size=4096, d_model=64, n_heads=4, mlp_hidden=176, n_prelude=1, n_core=2, n_coda=1,
        max_seq_len=128, mean_recurrence=4, backprop_depth=2,
    ),
    # CPU benchmark and demo runs.
    "small": ModelConfig(
        vocab_size=4096, d_model=256, n_heads=8, mlp_hidden=704, n_prelude=2, n_core=2, n_coda=2,
        max_seq_len=256, mean_recurrence=4, backprop_depth=4,
    ),
    # ≈1.0 B parameters: a single-node smoke test of the real pipeline.
    "1b": ModelConfig(
        vocab_size=65536, d_model=2560, n_heads=20, mlp_hidden=6912, n_prelude=2, n_core=6,
        n_coda=2, max_seq_len=4096, mean_recurrence=32, backprop_depth=8,
    ),
    # The published Huginn-3.5B shape.
    "huginn-3.5b": ModelConfig(
        vocab_size=65536, d_model=5280, n_heads=55, mlp_hidden=17920, n_prelude=2, n_core=4,
        n_coda=2, max_seq_len=4096, mean_recurrence=32, backprop_depth=8,
    ),
}
# fmt: on


def model_config(preset: str, **overrides: Any) -> ModelConfig:
    """A preset with some fields replaced; unknown presets or fields raise ConfigError."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown model preset {preset!r}; valid presets: {', '.join(PRESETS)}")
    names = [f.name for f in fields(ModelConfig)]
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise ConfigError(f"unknown model field(s) {', '.join(unknown)}; valid: {', '.join(names)}")
    return replace(PRESETS[preset], **overrides)


@dataclass
class CheckpointConfig:
    interval_steps: int = 1000  # save every N optimizer steps (and on SIGTERM / at the end)
    keep_last: int = 3  # newest valid checkpoints kept; 0 keeps every checkpoint
    keep_every: int = 0  # also keep steps divisible by this as milestones; 0 = no milestones
    async_save: bool = False  # copy state to host memory, write in a background thread
    verify: Literal["size", "full"] = "size"  # resume check: file sizes, or sizes + sha256
    on_error: Literal["continue", "stop"] = "continue"  # a failed save: keep training, or exit 1
    resume: str = "auto"  # auto (newest valid), never, or a checkpoint directory
    min_free_bytes: int = 0  # free space to leave on the filesystem after a save
    format: Literal["full", "sharded"] = "full"  # one file per concern by rank 0, or DCP shards

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError with one line naming the first invalid field."""
        for name in ("interval_steps", "keep_last", "keep_every", "min_free_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"checkpoint.{name} must be an integer, got {value!r}")
        if self.interval_steps < 1:
            raise ConfigError(f"checkpoint.interval_steps must be >= 1, got {self.interval_steps}")
        for name in ("keep_last", "keep_every", "min_free_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"checkpoint.{name} must be >= 0, got {getattr(self, name)}")
        if not isinstance(self.async_save, bool):
            raise ConfigError(
                f"checkpoint.async_save must be true or false, got {self.async_save!r}"
            )
        if self.format not in ("full", "sharded"):
            raise ConfigError(f"checkpoint.format must be full or sharded, got {self.format!r}")
        if self.verify not in ("size", "full"):
            raise ConfigError(f"checkpoint.verify must be size or full, got {self.verify!r}")
        if self.on_error not in ("continue", "stop"):
            raise ConfigError(
                f"checkpoint.on_error must be continue or stop, got {self.on_error!r}"
            )
        if not isinstance(self.resume, str) or not self.resume.strip():
            raise ConfigError(
                "checkpoint.resume must be auto, never or a checkpoint directory, "
                f"got {self.resume!r}"
            )


@dataclass
class DataConfig:
    path: str = ".demo/data"  # a directory written by `python -m trainer prepare`
    split: str = "train"
    # size: every shard's size at open (always); full: also its sha256 (reads every byte once)
    verify: Literal["size", "full"] = "size"


@dataclass
class TrainConfig:
    steps: int = 1000  # optimizer steps in total (a resumed run continues up to this)
    global_batch: int = 64  # samples (sequences) per optimizer step, whatever the world size
    micro_batch: int = 8  # samples per rank per forward/backward
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    max_nonfinite: int = 5  # consecutive non-finite steps before a rollback (or stop)
    on_nonfinite: Literal["rollback", "stop"] = "rollback"  # after max_nonfinite in a row
    max_rollbacks: int = 3  # rollbacks per trainer process before giving up (exit 4)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when available
    depth_per: Literal["step", "micro_batch"] = (
        "step"  # one recurrence draw per step or per micro-batch
    )
    deterministic: bool = False  # deterministic kernels (and CUBLAS_WORKSPACE_CONFIG on NVIDIA)


@dataclass
class OptimConfig:
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1  # on matrices only; norms and the embedding are not decayed
    schedule: Literal["cosine", "wsd"] = "cosine"
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # final lr as a fraction of lr
    cooldown_fraction: float = 0.2  # wsd: share of the steps spent decaying at the end


@dataclass
class EvalConfig:
    every: int = 0  # validate every N steps (and after the last); 0 disables
    batches: int = 4  # fixed number of global batches of the val split per evaluation
    depths: tuple[int, ...] = (1, 4, 8, 16, 32)  # recurrence depths to evaluate
    split: str = "val"


@dataclass
class CommConfig:
    compression: Literal["none", "bf16", "fp16"] = "none"  # gradient all-reduce wire dtype
    predivide_factor: float = 1.0  # divide by f before the all-reduce, by world/f after
    bucket_mb: float = 25.0  # DDP gradient bucket size
    timeout_s: float = 600.0  # process-group timeout for hung collectives
    startup_timeout_s: float = 120.0  # every rank must answer the startup all-reduce this soon


@dataclass
class ParallelConfig:
    strategy: Literal["ddp", "fsdp", "hsdp"] = (
        "ddp"  # how ranks hold the model (trainer/parallel.py)
    )
    replicas: int = 0  # hsdp: replica groups (0: one per node); shards within each
    offload: bool = False  # fsdp/hsdp on GPUs: parameters and optimizer state in host memory


@dataclass
class MetricsConfig:
    log_every: int = 10  # log line and status.json every N steps (metrics.jsonl gets every step)
    host: str = "0.0.0.0"
    port: int = 0  # Prometheus /metrics and /healthz on rank 0; 0 disables the endpoint


@dataclass
class Config:
    run_dir: str = ""
    seed: int = 0
    model: ModelConfig = field(default_factory=lambda: PRESETS["tiny"])
    preset: str = "tiny"  # the model preset the model section started from
    data: DataConfig = field(default_factory=lambda: DataConfig(path=""))
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir)


# Sections that are plain dataclasses built by keyword; `model` is built through its preset.
_SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "eval": EvalConfig,
    "comm": CommConfig,
    "parallel": ParallelConfig,
    "metrics": MetricsConfig,
}
_TOP_LEVEL: dict[str, type] = {"run_dir": str, "seed": int}


def valid_keys() -> list[str]:
    """Every dotted key a config file or override may set."""
    keys = [*_TOP_LEVEL, "model.preset"]
    keys += [f"model.{f.name}" for f in dataclasses.fields(ModelConfig)]
    for name, cls in _SECTIONS.items():
        keys += [f"{name}.{f.name}" for f in dataclasses.fields(cls)]
    return keys


def _unknown_key(key: str) -> ConfigError:
    candidates = valid_keys()
    section, _, leaf = key.rpartition(".")
    sections = sorted({k.rpartition(".")[0] for k in candidates if "." in k})
    close: list[str] = []
    if section and section not in sections:
        # A misspelt section (optimiser.weight_decay): the nearest section, then its field.
        near = difflib.get_close_matches(section, sections, n=1, cutoff=0.5)
        section = near[0] if near else section
    if section in sections:
        fields = [k.rpartition(".")[2] for k in candidates if k.rpartition(".")[0] == section]
        close = [f"{section}.{f}" for f in difflib.get_close_matches(leaf, fields, n=1)]
    if not close:
        close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    if not close:  # the right field in the wrong section: compare the leaf everywhere
        leaves = {k.rsplit(".", 1)[-1]: k for k in candidates}
        close = [leaves[m] for m in difflib.get_close_matches(leaf or key, list(leaves), n=1)]
    hint = f"; did you mean '{close[0]}'?" if close else "; see docs/trainer.md for valid keys"
    return ConfigError(f"unknown config key '{key}'{hint}")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """`value` (from YAML or an override string) as type `tp`, or a ConfigError."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        text = str(value).lower() if isinstance(value, str | bool) or value is None else value
        if text not in choices:
            raise ConfigError(f"{key} must be one of {', '.join(map(str, choices))}, got {value!r}")
        return text
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            return None
        return _coerce(value, members[0], key)
    if origin in (tuple, list):
        items: Any = value
        if isinstance(value, str):
            text = value.strip()
            try:
                items = yaml.safe_load(text) if text.startswith("[") else text.split(",")
            except yaml.YAMLError:
                raise ConfigError(f"{key}: cannot read {value!r} as a list, e.g. 1,4,8") from None
        if not isinstance(items, list | tuple):
            items = [items]
        args = typing.get_args(tp)
        if origin is list or (len(args) == 2 and args[1] is Ellipsis):
            item_types: list[Any] = [args[0]] * len(items)
        else:
            if len(items) != len(args):
                raise ConfigError(f"{key} needs {len(args)} values, got {len(items)}: {value!r}")
            item_types = list(args)
        coerced = [_coerce(v, t, key) for v, t in zip(items, item_types, strict=True)]
        return tuple(coerced) if origin is tuple else coerced
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("true", "yes", "on", "1"):
                return True
            if text in ("false", "no", "off", "0"):
                return False
            raise ValueError
        if tp is int:
            if isinstance(value, bool):
                raise ValueError
            number = float(value) if isinstance(value, str) and "e" in value.lower() else value
            if isinstance(number, float) and not number.is_integer():
                raise ValueError
            return int(number)
        if tp is float:
            number = float(value)
            if isinstance(value, bool) or not math.isfinite(number):
                raise ValueError
            return number
        if tp is str:
            if isinstance(value, dict | list):
                raise ValueError
            return str(value)
        if tp is Path:
            return Path(str(value))
    except (TypeError, ValueError):
        name = getattr(tp, "__name__", str(tp))
        raise ConfigError(f"{key} must be {name}, got {value!r}") from None
    raise ConfigError(f"{key}: unsupported field type {tp!r}")


def _build(cls: type, values: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in names:
            raise _unknown_key(f"{prefix}.{key}")
        kwargs[key] = _coerce(value, hints[key], f"{prefix}.{key}")
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field left out, e.g. data.path
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in kwargs]
        raise ConfigError(f"{prefix}: {exc}; set {prefix}.{missing[0]}") from None


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    if not all(parts) or len(parts) > 2:
        raise _unknown_key(key)
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set '{key}': '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override '{text}' must look like key=value, e.g. train.steps=20")
    return key.strip(), value.strip()


def from_dict(tree: dict[str, Any]) -> Config:
    """Build and validate a Config from a nested dict (YAML-shaped)."""
    if not isinstance(tree, dict):
        raise ConfigError("the config must be a mapping of sections, e.g. 'train: {steps: 10}'")
    kwargs: dict[str, Any] = {}
    for key, value in tree.items():
        if key in _TOP_LEVEL:
            kwargs[key] = _coerce(value, _TOP_LEVEL[key], key)
        elif key == "model" or key in _SECTIONS:
            if value is None:
                value = {}
            if not isinstance(value, dict):
                raise ConfigError(f"'{key}' must be a section (a mapping), got {value!r}")
            if key == "model":
                kwargs["model"], kwargs["preset"] = _build_model(value)
            else:
                kwargs[key] = _build(_SECTIONS[key], value, key)
        elif isinstance(value, dict) and value:
            # An unknown section: name its first field, so the hint can find the right section.
            raise _unknown_key(f"{key}.{next(iter(value))}")
        else:
            raise _unknown_key(str(key))
    cfg = Config(**kwargs)
    validate(cfg)
    return cfg


def _build_model(values: dict[str, Any]) -> tuple[ModelConfig, str]:
    values = dict(values)
    preset = str(values.pop("preset", "tiny"))
    if preset not in PRESETS:
        close = difflib.get_close_matches(preset, list(PRESETS), n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"valid: {', '.join(PRESETS)}"
        raise ConfigError(f"unknown model.preset '{preset}'; {hint}")
    hints = typing.get_type_hints(ModelConfig)
    overrides = {}
    for key, value in values.items():
        if key not in hints:
            raise _unknown_key(f"model.{key}")
        overrides[key] = _coerce(value, hints[key], f"model.{key}")
    # ModelConfig validates itself (positive sizes, heads dividing d_model, even head dim).
    return model_config(preset, **overrides), preset


def load_config(path: Path | str, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The config of a YAML file with `key=value` overrides applied on top."""
    path = Path(path)
    try:
        tree = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; pass --config FILE") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config file {path} is not valid YAML{where}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {path} must be a mapping of sections")
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
    return from_dict(tree)


def validate(cfg: Config) -> None:
    """Reject values that cannot work, one ConfigError naming the key."""
    t, o, e, c, m = cfg.train, cfg.optim, cfg.eval, cfg.comm, cfg.metrics
    checks = [
        (bool(cfg.run_dir), "run_dir must be set, e.g. run_dir=runs/my-run"),
        (bool(str(cfg.data.path)), "data.path must be set to a prepared data directory"),
        (t.steps > 0, f"train.steps must be > 0, got {t.steps}"),
        (t.global_batch > 0, f"train.global_batch must be > 0, got {t.global_batch}"),
        (t.micro_batch > 0, f"train.micro_batch must be > 0, got {t.micro_batch}"),
        (
            t.micro_batch > 0 and t.global_batch % t.micro_batch == 0,
            f"train.global_batch={t.global_batch} must be a multiple of "
            f"train.micro_batch={t.micro_batch}",
        ),
        (t.grad_clip >= 0, f"train.grad_clip must be >= 0, got {t.grad_clip}"),
        (t.max_nonfinite >= 1, f"train.max_nonfinite must be >= 1, got {t.max_nonfinite}"),
        (t.max_rollbacks >= 0, f"train.max_rollbacks must be >= 0, got {t.max_rollbacks}"),
        (o.lr > 0, f"optim.lr must be > 0, got {o.lr}"),
        (o.eps > 0, f"optim.eps must be > 0, got {o.eps}"),
        (all(0 <= b < 1 for b in o.betas), f"optim.betas must lie in [0, 1), got {o.betas}"),
        (o.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {o.weight_decay}"),
        (o.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {o.warmup_steps}"),
        (0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio must lie in [0, 1], got {o.min_lr_ratio}"),
        (
            0 <= o.cooldown_fraction <= 1,
            f"optim.cooldown_fraction must lie in [0, 1], got {o.cooldown_fraction}",
        ),
        (e.every >= 0, f"eval.every must be >= 0, got {e.every}"),
        (e.batches >= 1, f"eval.batches must be >= 1, got {e.batches}"),
        (
            bool(e.depths) and all(d >= 1 for d in e.depths),
            f"eval.depths must be depths >= 1, got {e.depths}",
        ),
        (c.predivide_factor > 0, f"comm.predivide_factor must be > 0, got {c.predivide_factor}"),
        (c.bucket_mb > 0, f"comm.bucket_mb must be > 0, got {c.bucket_mb}"),
        (c.timeout_s > 0, f"comm.timeout_s must be > 0, got {c.timeout_s}"),
        (
            c.startup_timeout_s > 0,
            f"comm.startup_timeout_s must be > 0, got {c.startup_timeout_s}",
        ),
        (m.log_every >= 1, f"metrics.log_every must be >= 1, got {m.log_every}"),
        (0 <= m.port <= 65535, f"metrics.port must lie in 0..65535, got {m.port}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    if t.precision == "fp16" and cfg.parallel.strategy != "ddp":
        # Each rank would find infs only in its own gradient shard: the ranks could disagree on
        # which steps the loss scaler skips. bf16 needs no loss scaling.
        raise ConfigError(
            f"train.precision=fp16 is not supported with parallel.strategy="
            f"{cfg.parallel.strategy} (ranks would disagree on which steps overflow); use "
            "train.precision=bf16, or parallel.strategy=ddp"
        )


def check_world_size(cfg: Config, world_size: int) -> int:
    """Gradient-accumulation steps for this world size; the global batch never changes with it."""
    per_step = world_size * cfg.train.micro_batch
    if cfg.train.micro_batch < 1 or world_size < 1:
        raise ConfigError(
            f"train.micro_batch must be >= 1 (got {cfg.train.micro_batch}) and the world size "
            f">= 1 (got {world_size})"
        )
    if cfg.train.global_batch % per_step:
        raise ConfigError(
            f"train.global_batch={cfg.train.global_batch} is not divisible by world size "
            f"{world_size} × train.micro_batch={cfg.train.micro_batch}; change one of them"
        )
    return cfg.train.global_batch // per_step


def to_dict(cfg: Config) -> dict[str, Any]:
    """The resolved config as plain YAML-able data; `from_dict` of it gives the same Config."""

    def plain(value: Any) -> Any:
        if isinstance(value, tuple | list):
            return [plain(v) for v in value]
        if isinstance(value, Path):
            return str(value)
        return value

    tree: dict[str, Any] = {"run_dir": cfg.run_dir, "seed": cfg.seed}
    tree["model"] = {"preset": cfg.preset}
    tree["model"].update(dataclasses.asdict(cfg.model))
    for name in _SECTIONS:
        section = dataclasses.asdict(getattr(cfg, name))
        tree[name] = {k: plain(v) for k, v in section.items()}
    return tree


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
