"""Action `rlm.ops.copy`: `ansible.builtin.copy` that leaves an unchanged file in one remote call.

The builtin checks a file with a remote `stat` and then, when the content is already right, runs
the `file` module to apply owner, group and mode: two remote Python runs per file (about a third
of a CPU-second on a node) even when nothing changes. A no-change `site.yml` rerun is mostly such
files, on every node. Here the one `stat` decides: when the content, owner, group and mode it
reports are what the task asks for, the file is left alone without the `file` module. In every
other case (anything differs, a symlink, SELinux or file attributes asked for, `mode: preserve`,
`force: false`, `follow: true`) the builtin runs unchanged and reuses that `stat`. Same arguments
and results as the builtin; `rlm_one_call: true` in the result marks the short path.
"""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleError
from ansible.module_utils.parsing.convert_bool import boolean
from ansible.plugins.action.copy import ActionModule as BuiltinCopy
from ansible.utils.hashing import checksum

# Arguments whose effect the `stat` result cannot confirm: with any of them, the builtin decides.
_ATTRIBUTES_STAT_CANNOT_SEE = ("seuser", "serole", "setype", "selevel", "attributes", "attr")


def wanted_mode(mode: Any) -> int | None:
    """The permission bits an octal `mode` asks for; None for one the short path leaves alone."""
    if isinstance(mode, int) and not isinstance(mode, bool):
        return mode & 0o7777
    if isinstance(mode, str) and mode and all(c in "01234567" for c in mode):
        return int(mode, 8) & 0o7777
    return None


def attributes_match(args: dict[str, Any], status: dict[str, Any]) -> bool:
    """Whether a file `stat` described has the owner, group and mode the task asks for."""
    owner, group, mode = args.get("owner"), args.get("group"), args.get("mode")
    if owner is not None and str(owner) not in (status.get("pw_name"), str(status.get("uid"))):
        return False
    if group is not None and str(group) not in (status.get("gr_name"), str(status.get("gid"))):
        return False
    if mode is not None:
        bits = wanted_mode(mode)
        if bits is None or bits != int(status.get("mode", "-1"), 8):
            return False
    return True


class ActionModule(BuiltinCopy):
    _stat_ahead: tuple[tuple[str, bool], dict[str, Any]] | None = None

    def _short_path_applies(self, follow: bool) -> bool:
        args = self._task.args
        return (
            not follow
            and boolean(args.get("force", True), strict=False)
            and not boolean(args.get("raw", False), strict=False)
            and args.get("mode") != "preserve"
            and not any(args.get(name) is not None for name in _ATTRIBUTES_STAT_CANNOT_SEE)
        )

    def _copy_file(
        self, source_full, source_rel, content, content_tempfile, dest, task_vars, follow
    ):
        if not self._short_path_applies(follow):
            return super()._copy_file(
                source_full, source_rel, content, content_tempfile, dest, task_vars, follow
            )
        shell = self._connection._shell
        dest_file = (
            shell.join_path(dest, source_rel) if shell.path_has_trailing_slash(dest) else dest
        )
        status = self._execute_remote_stat(
            dest_file, all_vars=task_vars, follow=False, checksum=True
        )
        if (
            status["exists"]
            and status.get("isreg")
            and not status.get("islnk")
            and status["checksum"] == self._local_checksum(source_full)
            and attributes_match(self._task.args, status)
        ):
            self._remove_tempfile_if_content_defined(content, content_tempfile)
            return {
                "changed": False,
                "dest": dest_file,
                "path": dest_file,
                "checksum": status["checksum"],
                "owner": status.get("pw_name"),
                "group": status.get("gr_name"),
                "uid": status.get("uid"),
                "gid": status.get("gid"),
                "mode": status.get("mode"),
                "size": status.get("size"),
                "state": "file",
                "rlm_one_call": True,
            }
        # The builtin asks for the same stat first: give it this one rather than a second call.
        self._stat_ahead = ((dest_file, False), status)
        return super()._copy_file(
            source_full, source_rel, content, content_tempfile, dest, task_vars, follow
        )

    def _local_checksum(self, source_full: str) -> str | None:
        decrypt = boolean(self._task.args.get("decrypt", True), strict=False)
        try:
            real = self._loader.get_real_file(source_full, decrypt=decrypt)
        except AnsibleError:
            return None  # the builtin reports it
        try:
            return checksum(real)
        finally:
            self._loader.cleanup_tmp_file(real)

    def _execute_remote_stat(self, path, all_vars, follow, checksum=True):
        ahead, self._stat_ahead = self._stat_ahead, None
        if ahead is not None and ahead[0] == (path, follow) and checksum:
            return ahead[1]
        return super()._execute_remote_stat(
            path, all_vars=all_vars, follow=follow, checksum=checksum
        )
