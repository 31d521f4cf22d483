"""Action `rlm.ops.template`: `ansible.builtin.template` whose copy step is `rlm.ops.copy`.

The builtin renders on the controller and hands the file to the copy action it finds under
`ansible.legacy.copy`; this one hands it to `rlm.ops.copy`, so an unchanged file costs one remote
call instead of two. Same arguments and results as the builtin.
"""

from __future__ import annotations

from typing import Any

from ansible.plugins.action.template import ActionModule as BuiltinTemplate

COPY = "rlm.ops.copy"


class _CopyGoesToOurs:
    """The shared plugin loaders, but the copy action the builtin asks for is `rlm.ops.copy`."""

    def __init__(self, loaders: Any) -> None:
        self._loaders = loaders
        self.action_loader = _ActionLoader(loaders.action_loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loaders, name)


class _ActionLoader:
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def get(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self._loader.get(COPY if name == "ansible.legacy.copy" else name, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class ActionModule(BuiltinTemplate):
    def run(self, tmp=None, task_vars=None):
        loaders: Any = vars(self)["_shared_loader_obj"]  # set by ActionBase.__init__
        self._shared_loader_obj = _CopyGoesToOurs(loaders)
        return super().run(tmp, task_vars)
