"""Every algorithm across emulated hosts (network + UTS namespaces, TCP between
hosts, shared memory inside), where MPI_COMM_TYPE_SHARED groups ranks by host
for real.  Needs root and iproute2; skipped elsewhere."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from emulated_hosts import EmulatedHosts, cmd_verify, missing  # noqa: E402

EmulatedHosts.__test__ = False


def _namespaces_work() -> bool:
    if missing():
        return False
    probe = subprocess.run(["ip", "netns", "add", "marprobe0"], capture_output=True)
    subprocess.run(["ip", "netns", "del", "marprobe0"], capture_output=True)
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(
    not _namespaces_work(),
    reason="emulated hosts need root, iproute2 (ip, tc) and util-linux (unshare), and "
           "permission to create network namespaces",
)


#: hosts of equal ranks (two leaders, a power of two); hosts of 1, 2 and 3
#: ranks (a host of one rank, uneven hosts, an odd number of leaders, whose
#: inter-host algorithms fold).  More than 3 hosts are left to the
#: simulator (tests/test_schedule_serial.py: hierarchical on nodes of 3
#: ranks at every p up to 64, so up to 22 nodes)
LAYOUTS = [[2, 2], [1, 2, 3]]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["-".join(map(str, x)) for x in LAYOUTS])
def test_verify_across_emulated_hosts(layout):
    rc, text = cmd_verify(layout)
    assert rc == 0, text[-4000:]
    assert "# OK:" in text and " 0 wrong elements" in text
    # MPI sees one node per emulated host, with the ranks it was given
    expected = sorted(set(layout))
    assert f"ranks/node  : {expected}" in text, text[:2000]
    assert f"on {len(layout)} host(s)" in text
    assert "hierarchical" in text


def test_links_are_shaped_and_removed():
    with EmulatedHosts([1, 1], rate="100mbit") as hosts:
        shown = subprocess.run(["tc", "qdisc", "show", "dev", hosts.veth[0]],
                               capture_output=True, text=True).stdout
        assert "tbf" in shown and "100Mbit" in shown
        namespaces = hosts.ns
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in namespaces)
