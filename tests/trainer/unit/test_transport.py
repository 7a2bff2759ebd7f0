"""Which network NCCL used, judged from log lines in the shapes real NCCL / aws-ofi-nccl versions print."""

from __future__ import annotations

import pytest

from fsdp_trainer.contract import EfaPolicy, NetworkSpec, Transport, TransportReport
from fsdp_trainer.errors import TransportError
from fsdp_trainer.transport import (
    RankTransport,
    bus_bandwidth_gbps,
    combine,
    enforce,
    parse_nccl_log,
    worker_env,
)

# A rank at a node boundary on p4d/p5 with GPUDirect RDMA (aws-ofi-nccl 1.16, NCCL 2.27).
EFA_GDR_LOG = """\
llama-3-8b-node-0-0:194:194 [0] NCCL INFO Bootstrap: Using eth0:10.1.14.81<0>
llama-3-8b-node-0-0:194:194 [0] NCCL INFO NCCL version 2.27.3+cuda12.9
llama-3-8b-node-0-0:194:724 [0] NCCL INFO NET/Plugin: Successfully loaded external plugin libnccl-net.so
llama-3-8b-node-0-0:194:724 [0] NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.16.2
llama-3-8b-node-0-0:194:724 [0] NCCL INFO NET/OFI Selected provider is efa, fabric is efa (found 4 nics)
llama-3-8b-node-0-0:194:724 [0] NCCL INFO Using network Libfabric
llama-3-8b-node-0-0:194:724 [0] NCCL INFO comm 0x8b6b550 rank 0 nranks 16 cudaDev 0 busId 101c0 - Init START
llama-3-8b-node-0-0:194:712 [0] NCCL INFO Channel 00/0 : 3[0] -> 0[0] [receive] via NET/Libfabric/0/GDRDMA
llama-3-8b-node-0-0:194:712 [0] NCCL INFO Channel 01/0 : 3[0] -> 0[0] [receive] via NET/Libfabric/0/GDRDMA
llama-3-8b-node-0-0:194:712 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Libfabric/0/GDRDMA
llama-3-8b-node-0-0:194:712 [0] NCCL INFO Channel 01/1 : 1[1] -> 0[0] [receive] via NET/Libfabric/0/GDRDMA
node-0-0:194:712 [0] NCCL INFO Channel 01/1 : 1[1] -> 0[0] [receive] via NET/Libfabric/0/GDRDMA/Shared
llama-3-8b-node-0-0:194:713 [0] NCCL INFO Connected all rings
"""

# g6.12xlarge (L4, no GPUDirect RDMA): EFA through host memory.
EFA_LOG = """\
ip-10-0-1-5:88:88 [0] NCCL INFO NCCL version 2.26.2+cuda12.8
ip-10-0-1-5:88:120 [0] NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.20.0
ip-10-0-1-5:88:120 [0] NCCL INFO NET/OFI Selected provider is efa, fabric is efa (found 1 nics)
ip-10-0-1-5:88:120 [0] NCCL INFO Using network Libfabric
ip-10-0-1-5:88:121 [0] NCCL INFO Channel 00/0 : 7[3] -> 0[0] [receive] via NET/Libfabric/0
ip-10-0-1-5:88:121 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
"""

# p5 with PXN: the proxy rank follows the device, "/0(8)/GDRDMA".
PXN_GDR_LOG = """\
ip-10-1-2-3:77:99 [1] NCCL INFO NET/OFI Selected provider is efa, fabric is efa (found 32 nics)
ip-10-1-2-3:77:99 [1] NCCL INFO Using network Libfabric
ip-10-1-2-3:77:101 [1] NCCL INFO Channel 02/0 : 1[1] -> 9[1] [send] via NET/Libfabric/0(0)/GDRDMA
ip-10-1-2-3:77:101 [1] NCCL INFO Channel 03/0 : 9[1] -> 1[1] [receive] via NET/Libfabric/2(8)/GDRDMA
"""

# Older plugin wording: "Selected Provider", "AWS Libfabric".
OLD_PLUGIN_LOG = """\
0: ip-10-1-14-81:6158:9214 [2] NCCL INFO NET/OFI Selected Provider is efa (found 4 nics)
0: ip-10-1-14-81:6158:9214 [2] NCCL INFO Using network AWS Libfabric
0: ip-10-1-14-81:6158:9230 [2] NCCL INFO Channel 00/0 : 10[2] -> 2[2] [receive] via NET/AWS Libfabric/1/GDRDMA
"""

# The silent fallback: no plugin, TCP sockets.
SOCKET_LOG = """\
ip-10-0-1-6:91:91 [0] NCCL INFO NCCL version 2.26.2+cuda12.8
ip-10-0-1-6:91:130 [0] NCCL INFO NET/Plugin : Plugin load (libnccl-net.so) returned 2 : libnccl-net.so
ip-10-0-1-6:91:130 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.1.6<0>
ip-10-0-1-6:91:130 [0] NCCL INFO Using network Socket
ip-10-0-1-6:91:131 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/Socket/0
ip-10-0-1-6:91:131 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Socket/0
"""

# The plugin loaded but libfabric picked its TCP provider: Libfabric channels, no EFA.
LIBFABRIC_TCP_LOG = """\
ip-10-0-1-7:92:140 [0] NCCL INFO NET/OFI Selected provider is tcp, fabric is 10.0.0.0/16 (found 1 nics)
ip-10-0-1-7:92:140 [0] NCCL INFO Using network Libfabric
ip-10-0-1-7:92:141 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/Libfabric/0
"""

# A rank whose peers are all on its own node.
INTRA_NODE_LOG = """\
ip-10-0-1-5:89:89 [1] NCCL INFO Using network Libfabric
ip-10-0-1-5:89:122 [1] NCCL INFO Channel 00/0 : 1[1] -> 2[2] via P2P/CUMEM/read
ip-10-0-1-5:89:122 [1] NCCL INFO Channel 01/0 : 1[1] -> 0[0] via SHM/direct/direct
"""


def parse(text: str) -> RankTransport:
    return parse_nccl_log(text.splitlines(keepends=True))


@pytest.mark.parametrize(
    ("log", "channels"),
    [
        (EFA_GDR_LOG, {Transport.EFA_GPUDIRECT}),
        (EFA_LOG, {Transport.EFA}),
        (PXN_GDR_LOG, {Transport.EFA_GPUDIRECT}),
        (OLD_PLUGIN_LOG, {Transport.EFA_GPUDIRECT}),
        (SOCKET_LOG, {Transport.SOCKET}),
        (LIBFABRIC_TCP_LOG, {Transport.SOCKET}),
        (INTRA_NODE_LOG, set()),
    ],
    ids=["efa-gdr", "efa", "pxn-gdr", "old-plugin", "socket", "libfabric-tcp", "intra-node"],
)
def test_network_channels_are_classified(log: str, channels: set[Transport]) -> None:
    assert parse(log).network_channels == channels


def test_announced_network_and_version_are_read() -> None:
    efa = parse(EFA_GDR_LOG)
    assert efa.announced == Transport.EFA
    assert efa.nccl_version == "2.27.3+cuda12.9"
    assert parse(SOCKET_LOG).announced == Transport.SOCKET
    assert parse(LIBFABRIC_TCP_LOG).announced == Transport.SOCKET


def test_evidence_keeps_the_telling_lines_without_prefixes() -> None:
    evidence = parse(EFA_GDR_LOG).evidence
    assert "NET/OFI Selected provider is efa, fabric is efa (found 4 nics)" in evidence
    assert "Channel 00/0 : 3[0] -> 0[0] [receive] via NET/Libfabric/0/GDRDMA" in evidence
    assert not any("Init START" in line or "Connected all rings" in line for line in evidence)
    assert all("NCCL INFO" not in line for line in evidence)


def test_one_socket_rank_makes_the_job_socket() -> None:
    report = combine([parse(EFA_GDR_LOG), parse(SOCKET_LOG), parse(INTRA_NODE_LOG)], nodes=2)
    assert report.observed == Transport.SOCKET
    assert any("via NET/Socket/0" in line for line in report.evidence)


def test_gpudirect_only_when_every_network_channel_has_it() -> None:
    assert combine([parse(EFA_GDR_LOG), parse(INTRA_NODE_LOG)], nodes=2).observed == Transport.EFA_GPUDIRECT
    assert combine([parse(EFA_GDR_LOG), parse(EFA_LOG)], nodes=2).observed == Transport.EFA


def test_single_node_uses_no_network_whatever_nccl_announces() -> None:
    assert combine([parse(INTRA_NODE_LOG), parse(SOCKET_LOG)], nodes=1).observed == Transport.SINGLE


def test_without_channel_lines_the_announced_network_decides() -> None:
    announced_only = parse("h:1:1 [0] NCCL INFO Using network Socket\n")
    assert combine([announced_only], nodes=2).observed == Transport.SOCKET
    assert combine([parse("")], nodes=2).observed == Transport.UNKNOWN


def test_efa_required_rejects_a_socket_fallback_with_the_evidence() -> None:
    report = combine([parse(SOCKET_LOG)], nodes=2)
    with pytest.raises(TransportError, match="socket") as raised:
        enforce(EfaPolicy.REQUIRED, report)
    assert "via NET/Socket/0" in str(raised.value)
    assert raised.value.kind == "transport"
    enforce(EfaPolicy.PREFERRED, report)  # preferred only reports


@pytest.mark.parametrize("observed", [Transport.EFA, Transport.EFA_GPUDIRECT, Transport.SINGLE])
def test_efa_required_accepts_efa_and_single_node(observed: Transport) -> None:
    enforce(EfaPolicy.REQUIRED, TransportReport(observed=observed))


def test_bus_bandwidth_follows_nccl_tests_definition() -> None:
    # 1 GB all-reduced across 8 ranks in 0.1 s: algbw 10 GB/s, busbw 10 * 2 * 7 / 8 = 17.5 GB/s.
    assert bus_bandwidth_gbps(10**9, 8, 0.1) == pytest.approx(17.5)
    assert bus_bandwidth_gbps(10**9, 1, 0.1) == 0.0


def test_worker_env_turns_on_nccl_logging_and_lets_the_user_override() -> None:
    env = worker_env(NetworkSpec(nccl_env={"FI_PROVIDER": "tcp", "NCCL_SOCKET_IFNAME": "eth0"}), "run-1")
    assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_DEBUG_SUBSYS"] == "INIT,NET"
    assert (
        "%h" in env["NCCL_DEBUG_FILE"]
        and "%p" in env["NCCL_DEBUG_FILE"]
        and "run-1" in env["NCCL_DEBUG_FILE"]
    )
    assert env["FI_PROVIDER"] == "tcp" and env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert "FI_PROVIDER" not in worker_env(NetworkSpec(efa=EfaPolicy.DISABLED), "run-1")
