"""The multi-host test rig: hosts node1..nodeN as network namespaces with overlay roots and sshd.

See docs/rig.md. `python -m tests.rig up N | down | status` by hand; `Rig` from Python;
the `rig` and `make_rig` fixtures in tests/conftest.py from pytest.
"""

from tests.rig.errors import RigError
from tests.rig.layout import MAX_HOSTS, RIG_ID_ENV, rig_id_from_env
from tests.rig.rig import ExecError, Host, Rig, teardown_all

__all__ = [
    "MAX_HOSTS",
    "RIG_ID_ENV",
    "ExecError",
    "Host",
    "Rig",
    "RigError",
    "rig_id_from_env",
    "teardown_all",
]
