"""CPU binding from a node's topology (clusterspec/binding.py): gres.conf Cores= in Slurm's core
numbering and each rank's CPUs, on recorded tool output of 2-socket 8-GPU nodes (NVIDIA and AMD,
sources named in each fixture) and on this machine's own lscpu; `pin` checked by the kernel.

The CPU tables of the recorded GPU nodes were not published with their GPU topology: they are
built by `x86_lscpu` with the numbering Linux gives x86 CPUs (the first thread of every core,
socket 0 first, then their second threads), and each test first checks that the table agrees
with what the recorded output itself says of the node (its CPU Affinity column, its CPU count).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from clusterspec import binding
from clusterspec.binding import BindingError, NodeCpus
from clusterspec.vendors import nvidia_topology

FIXTURES = Path(__file__).parent / "fixtures"
TOPOLOGY = Path(__file__).parents[1] / "rlmctl" / "fixtures" / "topology"
ROCM_SMI_JSON = Path(__file__).parents[1] / "monitoring" / "fixtures" / "rocm-smi-showallinfo.json"
REPO = Path(__file__).parents[2]


def recorded(path: Path) -> str:
    """A fixture without its "# source:"/"# what:" header: exactly what the tool printed."""
    lines = path.read_text().splitlines(keepends=True)
    return "".join(line for line in lines if not line.startswith(("# source: ", "# what: ")))


def x86_lscpu(sockets: int, cores: int, threads: int) -> str:
    """`lscpu --parse=CPU,CORE,SOCKET,NODE` of a node with one NUMA node per socket, numbered as
    Linux numbers x86 CPUs: CPU t*sockets*cores + s*cores + c is thread t of core c of socket s."""
    rows = ["# CPU,Core,Socket,Node"]
    for thread in range(threads):
        for socket in range(sockets):
            for core in range(cores):
                cpu = thread * sockets * cores + socket * cores + core
                rows.append(f"{cpu},{socket * cores + core},{socket},{socket}")
    return "\n".join(rows) + "\n"


def test_every_fixture_names_its_source() -> None:
    for path in FIXTURES.iterdir():
        assert path.read_text().startswith("# source: "), path.name


def test_lscpu_of_this_machine_recorded_and_live() -> None:
    node = NodeCpus.from_lscpu(recorded(FIXTURES / "lscpu-parse-kvm-2cpu.txt"))
    assert (node.ids, node.sockets, node.cores_per_socket, node.threads_per_core) == (
        [0, 1],
        1,
        2,
        1,
    )
    live = subprocess.run(list(binding.LSCPU), capture_output=True, text=True, check=True)
    assert NodeCpus.from_lscpu(live.stdout).ids == sorted(os.sched_getaffinity(0))


def test_slurm_numbers_cores_socket_by_socket_not_by_linux_cpu_id() -> None:
    node = NodeCpus.from_lscpu(recorded(FIXTURES / "lscpu-parse-2socket-interleaved.txt"))
    assert (node.sockets, node.cores_per_socket, node.threads_per_core) == (2, 4, 1)
    # CPUs 0,2,4,6 are socket 0 (Slurm cores 0-3), CPUs 1,3,5,7 socket 1 (cores 4-7).
    assert node.core_index() == {0: 0, 2: 1, 4: 2, 6: 3, 1: 4, 3: 5, 5: 6, 7: 7}
    assert node.slurm_cores([1, 3, 5, 7]) == "4-7"


def test_nvidia_2_sockets_8_gpus_gres_cores_and_rank_plan() -> None:
    text = recorded(TOPOLOGY / "nvidia-smi-topo-8x4090-nic-far-socket.txt")
    node = NodeCpus.from_lscpu(x86_lscpu(sockets=2, cores=56, threads=2))
    recorded_affinity = nvidia_topology.parse(text).cpu_affinity
    assert len(node.ids) == 224 and recorded_affinity["4"] == "56-111,168-223"
    near = binding.gpu_cpus(node, "nvidia", text, 8)
    # From the NUMA column and the CPU table: the same CPUs the CPU Affinity column prints.
    assert {str(g): binding.format_cpulist(c) for g, c in near.items()} == recorded_affinity
    assert binding.gres_lines(node, near) == [
        {"first": 0, "last": 3, "cores": "0-55"},
        {"first": 4, "last": 7, "cores": "56-111"},
    ]
    plan = binding.rank_plan(node, near)
    assert plan.cpu_lists == [
        "0-13,112-125",
        "14-27,126-139",
        "28-41,140-153",
        "42-55,154-167",
        "56-69,168-181",
        "70-83,182-195",
        "84-97,196-209",
        "98-111,210-223",
    ]
    assert plan.cpus_per_task == 28
    masks = plan.cpu_bind.removeprefix("mask_cpu:").split(",")
    assert [{b for b in range(224) if int(m, 16) >> b & 1} for m in masks] == [
        set(cpus) for cpus in plan.ranks
    ]


def test_a_topology_read_inside_a_job_still_binds_to_the_whole_numa_node() -> None:
    text = recorded(FIXTURES / "nvidia-smi-topo-a100-pcie-8gpu-in-job.txt")
    topo = nvidia_topology.parse(text)
    # The empty CPU Affinity cells of GPUs 4-7 do not shift their NUMA column.
    assert topo.cpu_affinity == {str(g): "0-15,56-71" for g in range(4)}
    assert topo.numa == {str(g): str(g // 4) for g in range(8)}
    node = NodeCpus.from_lscpu(x86_lscpu(sockets=2, cores=28, threads=2))  # 112 CPUs, as posted
    near = binding.gpu_cpus(node, "nvidia", text, 8)
    assert binding.format_cpulist(near[0]) == "0-27,56-83"  # not the job's 0-15,56-71
    assert binding.format_cpulist(near[7]) == "28-55,84-111"
    assert binding.rank_plan(node, near).cpu_lists[:2] == ["0-6,56-62", "7-13,63-69"]


def test_without_numa_information_the_cpu_affinity_column_decides() -> None:
    # A 4-GPU H100 VM: GPU0's CPUs are 6,14,22,30 on (host) NUMA node 3, which the guest's own
    # CPU table does not have.
    text = recorded(TOPOLOGY / "nvidia-smi-topo-h100-4gpu-nv6.txt")
    node = NodeCpus.from_lscpu(x86_lscpu(sockets=1, cores=32, threads=1))
    near = binding.gpu_cpus(node, "nvidia", text, 4)
    assert [binding.format_cpulist(near[g]) for g in range(4)] == [
        "6,14,22,30",
        "4,12,20,28",
        "7,15,23,31",
        "5,13,21,29",
    ]
    assert binding.rank_plan(node, near).cpus_per_task == 4


def test_amd_2_numa_nodes_8_gpus() -> None:
    text = recorded(FIXTURES / "rocm-smi-showtoponuma-8gpu-2numa.txt")
    node = NodeCpus.from_lscpu(x86_lscpu(sockets=2, cores=64, threads=2))
    facts = binding.node_binding(x86_lscpu(2, 64, 2), "amd", 8, text, ROCM_SMI_JSON.read_text())
    assert facts["gres"] == [
        {"first": 0, "last": 3, "cores": "0-63"},
        {"first": 4, "last": 7, "cores": "64-127"},
    ]
    assert (facts["sockets"], facts["cores_per_socket"], facts["threads_per_core"]) == (2, 64, 2)
    assert facts["gpu_type"] == "mi250x"
    assert facts["plan"]["cpus_per_task"] == 32
    assert facts["plan"]["ranks"][4] == "64-79,192-207"
    near = binding.gpu_cpus(node, "amd", text, 8)
    assert facts["plan"][binding.RANK_CPUS_ENV] == ";".join(binding.rank_plan(node, near).cpu_lists)


@pytest.mark.parametrize(
    ("vendor", "names", "expected"),
    [
        ("nvidia", ["NVIDIA H100 80GB HBM3"] * 8, "h100"),
        ("nvidia", ["NVIDIA H100 PCIe"], "h100_pcie"),
        ("nvidia", ["NVIDIA GeForce RTX 4090"], "geforce_rtx_4090"),
        ("amd", ["AMD Instinct MI300X"], "mi300x"),
    ],
)
def test_gres_type_names_the_model(vendor: str, names: list[str], expected: str) -> None:
    assert binding.gpu_type(vendor, names) == expected


def test_facts_that_do_not_add_up_are_one_line_errors() -> None:
    node = NodeCpus.from_lscpu(recorded(FIXTURES / "lscpu-parse-kvm-2cpu.txt"))
    text = recorded(TOPOLOGY / "nvidia-smi-topo-gb200-4gpu.txt")
    with pytest.raises(
        BindingError, match="nvidia-smi topo -m lists 4 GPUs, the node should have 8"
    ):
        binding.gpu_cpus(node, "nvidia", text, 8)
    with pytest.raises(BindingError, match=r"share 2 free cores .*fewer than one per GPU"):
        binding.rank_plan(node, binding.gpu_cpus(node, "none", "", 3))
    with pytest.raises(BindingError, match="several models"):
        binding.gpu_type("nvidia", ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"])
    with pytest.raises(BindingError, match="no CPU table"):
        binding.parse_lscpu("Architecture: x86_64\n")


def test_cpu_workers_split_the_node_and_pin_is_what_the_kernel_applies() -> None:
    plan = binding.node_binding(recorded(FIXTURES / "lscpu-parse-kvm-2cpu.txt"), "none", 2)["plan"]
    assert plan["ranks"] == ["0", "1"] and plan["cpus_per_task"] == 1
    env = {**os.environ, binding.RANK_CPUS_ENV: plan[binding.RANK_CPUS_ENV], "LOCAL_RANK": "1"}
    shown = subprocess.run(
        [
            sys.executable,
            "-m",
            "clusterspec.binding",
            "pin",
            "--",
            "grep",
            "Cpus_allowed_list",
            "/proc/self/status",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        check=True,
    ).stdout
    assert shown.split() == ["Cpus_allowed_list:", "1"]


def test_plan_on_this_node_and_a_bad_file_is_one_line() -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "clusterspec.binding", "plan", *args],
            capture_output=True,
            text=True,
            cwd=REPO,
        )

    here = run("--gpus", "1", "--vendor", "none")
    assert here.returncode == 0, here.stderr
    assert '"cpus_per_task": ' + str(len(os.sched_getaffinity(0))) in here.stdout
    bad = run("--gpus", "1", "--lscpu", str(TOPOLOGY / "nvidia-smi-topo-gb200-4gpu.txt"))
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and "no CPU table" in bad.stderr
