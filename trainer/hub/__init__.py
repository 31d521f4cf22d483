"""Modelling code shipped into every export directory (`python -m trainer export`).

`configuration_raven.py` and `modeling_raven.py` are this project's own implementation of the
published Huginn architecture as a transformers `PretrainedConfig` / `PreTrainedModel`. They import
only torch and transformers (never `trainer`), because an export is loaded where rlm-ops is not
installed: `AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True)` finds them
through the `auto_map` of the export's config.json. Nothing in the trainer imports them.
"""

from pathlib import Path

MODELLING_FILES = tuple(
    Path(__file__).with_name(name) for name in ("configuration_raven.py", "modeling_raven.py")
)
