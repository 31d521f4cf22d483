"""tests/suite_cpu.py on real accounting records.

tests/fixtures/pacct-make-test.bin: 19 records of `struct acct_v3` that Linux wrote during a
`make test` on this kind of machine (2026-12-04, acct(2) turned on by the acct package's accton,
kernel's own format), cut from the file with their bytes unchanged: a trainer rank that ran g++
(inductor compiling), its torchrun and the pytest worker that started it, an ansible-playbook run
and two of its forks, and a rig node's sshd and systemd that had, by then, the PID of that
ansible-playbook (PIDs wrap at 32768, about every 12 minutes of `make test`). The acct package's
dump-acct read the same bytes as the figures asserted below.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import suite_cpu

FIXTURE = Path(__file__).parent / "fixtures" / "pacct-make-test.bin"


@pytest.fixture(scope="module")
def records() -> list[suite_cpu.Process]:
    return list(suite_cpu.read_records(FIXTURE.read_bytes()))


def find(records: list[suite_cpu.Process], pid: int, comm: str) -> suite_cpu.Process:
    (found,) = [p for p in records if p.pid == pid and p.comm.startswith(comm)]
    return found


def test_records_read_as_dump_acct_reads_them(records: list[suite_cpu.Process]) -> None:
    assert len(records) == 19
    worker = find(records, 18560, "python3")  # dump-acct: 5640 user + 881 system ticks
    assert (worker.ppid, worker.cpu_s) == (18555, pytest.approx(65.21))
    playbook = find(records, 16934, "ansible-playboo")  # 861 + 489 ticks, 12905 ticks elapsed
    assert playbook.cpu_s == pytest.approx(13.5)
    assert playbook.end - playbook.start == pytest.approx(129.05)


def test_each_process_goes_to_its_nearest_named_ancestor(
    records: list[suite_cpu.Process],
) -> None:
    by_pid = suite_cpu.index_by_pid(records)
    of = {(p.pid, p.comm): suite_cpu.category_of(p, by_pid) for p in records}
    assert of[(18004, "g++")] == of[(17980, "pt_gloo_runloop")]  # a rank's compiler: the trainer's
    assert of[(18004, "g++")].startswith("trainer:")
    assert of[(17956, "python3")].startswith("tests:")  # the test's `python -m torch...run`
    # The same PID twice, told apart by when each lived: a fork of ansible-playbook 16934 is the
    # controller's, node sshd 16934 (started later) the node's.
    assert of[(21371, "ansible-playboo")].startswith("controller:")
    assert of[(16934, "sshd")].startswith("nodes:")
    assert of[(16500, "systemd-shutdow")].startswith("nodes:")
    assert of[(18144, "make")] == suite_cpu.OUTSIDE


def test_the_table_sums_every_process_once(records: list[suite_cpu.Process]) -> None:
    text = suite_cpu.table(records)
    total = sum(p.cpu_s for p in records)
    assert text.splitlines()[0] == f"{total / 60:.1f} CPU-min in 19 processes"
    groups = suite_cpu.categorise(records)
    assert sum(len(members) for members in groups.values()) == 19


def test_a_missing_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        suite_cpu.main(["--read", str(tmp_path / "nope")])
    assert str(exit_info.value) == f"error: no accounting file at {tmp_path / 'nope'}"


def test_records_of_another_format_are_refused() -> None:
    with pytest.raises(ValueError, match="not acct_v3"):
        list(suite_cpu.read_records(bytes(64)))


def test_per_test_file_each_process_goes_to_the_test_its_worker_ran_when_it_started(
    records: list[suite_cpu.Process],
) -> None:
    """A timeline as tests/conftest.py writes it, around the recorded processes: worker 18557
    ran one trainer file; worker 18560 a first file, then from just before ansible-playbook 16934
    started, a second one."""
    playbook = find(records, 16934, "ansible-playboo")
    timeline = suite_cpu.read_timeline(
        "\n".join(
            json.dumps(line)
            for line in (
                {"pid": 18557, "test": "tests/trainer/test_t.py::test_one", "time": 0.0},
                {"pid": 18560, "test": "tests/test_a.py::test_one", "time": 0.0},
                {"pid": 18560, "test": "tests/test_b.py::test_two", "time": playbook.start - 1},
            )
        )
    )
    per_file = suite_cpu.by_test_file(records, timeline)
    rank = find(records, 17980, "pt_gloo_runloop")
    torchrun = find(records, 17971, "pt_elastic")
    launcher = find(records, 17956, "python3")
    assert per_file["tests/trainer/test_t.py"] == pytest.approx(
        rank.cpu_s + torchrun.cpu_s + launcher.cpu_s  # and the rank's g++ (0.0 s)
    )
    forks = [p for p in records if p.ppid == 16934 and p.comm.startswith("ansible")]
    assert per_file["tests/test_b.py"] >= playbook.cpu_s + sum(p.cpu_s for p in forks)
    workers = find(records, 18557, "python3").cpu_s + find(records, 18560, "python3").cpu_s
    assert per_file[suite_cpu.WORKERS] == pytest.approx(workers)
    assert sum(per_file.values()) == pytest.approx(sum(p.cpu_s for p in records))
