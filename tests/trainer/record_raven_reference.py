"""Record fixtures/raven_reference.json from the published Huginn code (run by hand, not by CI).

The published modelling code (seal-rg/recurrent-pretraining: recpre/raven_config_minimal.py and
recpre/raven_modeling_minimal.py) is not on PyPI and this repository does not ship it. With both
files in a package directory `raven_ref/` on PYTHONPATH and transformers 4.57.x installed:

    PYTHONPATH=DIR_WITH_raven_ref .venv/bin/python -m tests.trainer.record_raven_reference

It exports hub_model.formula_model() with `python -m trainer export`'s code, loads the export with
the published `RavenForCausalLM.from_pretrained`, and records what the suite checks without it:
the published config class's constructor (its parameters, and the `tie_word_embeddings` it passes
to transformers itself), the tensor names its model loads, its missing/unexpected keys for the
export, and its float32 logits for hub_model.IDS at hub_model.NUM_STEPS from a fixed start state.
"""

from __future__ import annotations

import base64
import inspect
import json
import subprocess
import tempfile
from pathlib import Path

import torch
import transformers
from raven_ref.raven_config_minimal import RavenConfig  # type: ignore[import-not-found]
from raven_ref.raven_modeling_minimal import RavenForCausalLM  # type: ignore[import-not-found]

from tests.trainer.hub_model import (
    FIXTURE,
    IDS,
    NUM_STEPS,
    formula_model,
    initial_state,
    save_checkpoint,
)
from trainer.export import export_checkpoint


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = save_checkpoint(formula_model(), Path(tmp) / "run", 1, None)
        out = export_checkpoint(ckpt, Path(tmp) / "export")
        model, info = RavenForCausalLM.from_pretrained(out, output_loading_info=True)
        with torch.no_grad():
            logits = model.eval()(
                torch.tensor(IDS), input_states=initial_state(), num_steps=NUM_STEPS
            ).logits
    source = inspect.getsource(RavenConfig.__init__)
    init = inspect.signature(RavenConfig.__init__).parameters.values()
    record = {
        "recorded": (
            "by tests/trainer/record_raven_reference.py from seal-rg/recurrent-pretraining "
            f"{_commit()} recpre/raven_*_minimal.py, transformers {transformers.__version__}, "
            f"torch {torch.__version__}"
        ),
        "config_parameters": {p.name: p.default for p in init if p.name not in ("self", "kwargs")},
        "passes_to_transformers": [
            name for name in ("tie_word_embeddings",) if f"{name}=" in source.split("super().")[-1]
        ],
        "attribute_map": RavenConfig.attribute_map,
        "model_type": RavenConfig.model_type,
        "state_dict_keys": sorted(model.state_dict()),
        "loading_info": {k: sorted(map(str, v)) for k, v in info.items()},
        "logits_float32": base64.b64encode(logits.float().contiguous().numpy().tobytes()).decode(),
        "logits_shape": list(logits.shape),
    }
    FIXTURE.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {FIXTURE}: {info}")


def _commit() -> str:
    import raven_ref  # type: ignore[import-not-found]

    where = Path(raven_ref.__file__).parent
    done = subprocess.run(
        ["git", "-C", str(where), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip() or "59e0b69"


if __name__ == "__main__":
    main()
