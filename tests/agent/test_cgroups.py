"""Process → container mapping from /proc/<pid>/cgroup."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeagent.cgroups import CgroupReader, container_id_from_cgroup

CID = "62500524981c9b7763fe314a192777853afdb3068eea7e7ec474ea543608c4d3"
OUTER = "a" * 64

V1_CGROUPFS = "\n".join(
    f"{n}:{ctrl}:/docker/{CID}"
    for n, ctrl in enumerate(["", "cpu", "cpuacct", "cpuset", "memory", "devices"])
) + "\n0::/docker/" + CID + "\n"

CASES = {
    "v1 cgroupfs (as on the test machine)": (V1_CGROUPFS, CID),
    "v1 systemd": (f"12:pids:/system.slice/docker-{CID}.scope\n"
                   f"4:memory:/system.slice/docker-{CID}.scope\n1:name=systemd:/system.slice/"
                   f"docker-{CID}.scope\n", CID),
    "v2 systemd": (f"0::/system.slice/docker-{CID}.scope\n", CID),
    "v2 systemd, nested init cgroup": (f"0::/system.slice/docker-{CID}.scope/init\n", CID),
    "v2 cgroupfs": (f"0::/docker/{CID}\n", CID),
    "docker in docker: innermost wins": (f"0::/docker/{OUTER}/docker/{CID}\n", CID),
    "kubernetes containerd": (f"0::/kubepods.slice/kubepods-besteffort.slice/"
                              f"kubepods-pod1.slice/cri-containerd-{CID}.scope\n", CID),
    "v1 with some controllers at the root": (f"9:name=systemd:/\n8:pids:/\n"
                                             f"4:memory:/docker/{CID}\n0::/\n", CID),
    "host process, v2": ("0::/user.slice/user-0.slice/session-1.scope\n", None),
    "host process, v1": ("9:name=systemd:/\n4:memory:/process_api/a5b411f49018aaa18bb905d3\n",
                         None),
    "empty": ("", None),
    "garbage": ("not a cgroup file\n::\n", None),
    "id too short": (f"0::/docker/{CID[:63]}\n", None),
    "uppercase hex is not docker's": (f"0::/docker/{CID.upper()}\n", None),
}


@pytest.mark.parametrize("content,expected", CASES.values(), ids=CASES.keys())
def test_container_id_from_cgroup(content: str, expected: str | None) -> None:
    assert container_id_from_cgroup(content) == expected


@given(st.text())
def test_parser_never_raises(content: str) -> None:
    result = container_id_from_cgroup(content)
    assert result is None or (len(result) == 64 and result in content)


@settings(max_examples=50)
@given(st.from_regex(r"\A[0-9a-f]{64}\Z"), st.sampled_from(["/docker/{}", "/system.slice/"
       "docker-{}.scope", "/docker/{}/sub", "/a/b/docker-{}.scope/init"]))
def test_any_id_in_any_shape(cid: str, shape: str) -> None:
    assert container_id_from_cgroup(f"0::{shape.format(cid)}\n") == cid


def fake_proc(root: Path, pid: int, cgroup: str, start: int = 12345) -> None:
    (root / str(pid)).mkdir(parents=True, exist_ok=True)
    (root / str(pid) / "cgroup").write_text(cgroup)
    # comm with spaces and a parenthesis, as a process may name itself
    fields = ["S"] + ["0"] * 18 + [str(start)] + ["0"] * 10
    (root / str(pid) / "stat").write_text(f"{pid} (evil ) name) " + " ".join(fields) + "\n")


def test_reader_maps_and_caches(tmp_path: Path) -> None:
    fake_proc(tmp_path, 10, f"0::/docker/{CID}\n")
    fake_proc(tmp_path, 11, "0::/user.slice\n")
    reader = CgroupReader(tmp_path)
    assert reader.containers_of([10, 11, 12]) == {10: CID}
    # cached by (pid, start time): the same process is not read again ...
    (tmp_path / "10" / "cgroup").write_text(f"0::/docker/{OUTER}\n")
    assert reader.container_of(10) == CID
    # ... but a reused pid (another start time) is
    fake_proc(tmp_path, 10, f"0::/docker/{OUTER}\n", start=99999)
    assert reader.container_of(10) == OUTER


def test_reader_on_this_machine() -> None:
    # Our own process runs on the host (or in some container): it must not raise either way.
    found = CgroupReader().container_of(os.getpid())
    assert found is None or len(found) == 64
    assert CgroupReader().container_of(2**22 + 12345) is None  # no such pid
