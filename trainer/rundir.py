"""The run directory contract moved to `runcontract` (torch-free, beside clusterspec); these names
stay importable from here until every caller imports them from there."""

from __future__ import annotations

from runcontract.exitcodes import ExitCode as ExitCode
from runcontract.records import Event as Event
from runcontract.records import Status as Status
from runcontract.records import fold_state as fold_state
from runcontract.records import stopped_before_end as stopped_before_end
from runcontract.rundir import CHECKPOINT_DIR_RE as CHECKPOINT_DIR_RE
from runcontract.rundir import MANIFEST_FORMAT as MANIFEST_FORMAT
from runcontract.rundir import MANIFEST_NAME as MANIFEST_NAME
from runcontract.rundir import RUN_NAME_MAX as RUN_NAME_MAX
from runcontract.rundir import RUN_NAME_RE as RUN_NAME_RE
from runcontract.rundir import CheckpointInfo as CheckpointInfo
from runcontract.rundir import RunDir as RunDir
from runcontract.rundir import RunDirBusy as RunDirBusy
from runcontract.rundir import RunDirUnwritable as RunDirUnwritable
from runcontract.rundir import append_jsonl as append_jsonl
from runcontract.rundir import check_run_name as check_run_name
from runcontract.rundir import checkpoint_dir_name as checkpoint_dir_name
from runcontract.rundir import read_json as read_json
from runcontract.rundir import read_jsonl as read_jsonl
from runcontract.rundir import sha256_file as sha256_file
from runcontract.rundir import verify_checkpoint as verify_checkpoint
from runcontract.rundir import write_json_atomic as write_json_atomic
from runcontract.rundir import write_manifest as write_manifest
from runcontract.states import ACTIVE_STATES as ACTIVE_STATES
from runcontract.states import EVENT_STATES as EVENT_STATES
from runcontract.states import TRANSITIONS as TRANSITIONS
from runcontract.states import EventKind as EventKind
from runcontract.states import RunState as RunState
from runcontract.states import allowed as allowed
from runcontract.states import parse_state as parse_state
