"""The run contract: what the trainer, rlmctl and the exporter agree on, at the bottom of the tree.

- `rundir`: the run directory on the shared filesystem (paths, status, events, checkpoint
  manifests, the trainer's lock, how a launcher ends an attempt);
- `states`: run states, event kinds and the transitions allowed (the one state machine);
- `records`: the typed `Status` and `Event` records;
- `exitcodes`: the trainer's exit codes and the one ranking of an attempt's codes;
- `config`: the trainer's config schema (dataclasses, presets, YAML + overrides, validation);
- `errors`: the one-line user errors with their exit codes.

Standard library and PyYAML only (a base dependency), no torch, numpy or ansible
(tests/test_imports.py), so that `rlmctl` and `rlm-exporter` work on an install without
`[train]`; the trainer imports its config sections and the run directory from here.
"""
