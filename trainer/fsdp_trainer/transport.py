"""Which network the collectives actually used, from NCCL's own log lines, and the workers' NCCL environment.

NCCL picks its network at communicator init and falls back to TCP sockets silently when the EFA plugin or
device is missing. The evidence is in its INFO log (subsystems INIT and NET), written per rank to
NCCL_DEBUG_FILE. Line shapes seen in real logs ("host:pid:tid [dev] NCCL INFO ..." prefixes vary):

    NCCL INFO NCCL version 2.27.3+cuda12.9
    NCCL INFO NET/OFI Selected provider is efa, fabric is efa (found 1 nics)   (older: "Selected Provider")
    NCCL INFO Using network Libfabric                                          (older: "AWS Libfabric")
    NCCL INFO NET/Socket : Using [0]eth0:10.1.2.3<0>
    NCCL INFO Channel 03/0 : 11[3] -> 3[3] [receive] via NET/Libfabric/3/GDRDMA
    NCCL INFO Channel 02/0 : 1[1] -> 9[1] [send] via NET/Libfabric/0(0)/GDRDMA        (PXN: proxy rank 0)
    NCCL INFO Channel 00/0 : 1[0] -> 0[0] [send] via NET/Socket/0
    NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read                  (intra-node: no network)
"""

from __future__ import annotations

import glob
import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from fsdp_trainer import distributed
from fsdp_trainer.contract import EfaPolicy, NetworkSpec, Transport, TransportReport, Versions
from fsdp_trainer.errors import TransportError

log = logging.getLogger(__name__)

NCCL_LOG_DIR = "/tmp"
# PXN channels name the proxy rank after the device: "via NET/Libfabric/0(1)/GDRDMA".
_CHANNEL = re.compile(r"via NET/(?P<net>[A-Za-z][A-Za-z ]*?)/\d+(?:\(\d+\))?(?P<gdr>/GDRDMA)?")
_USING_NETWORK = re.compile(r"Using network (?P<net>[A-Za-z][A-Za-z ]*?)\s*$")
_OFI_PROVIDER = re.compile(r"NET/OFI Selected provider is (?P<provider>[\w-]+)", re.IGNORECASE)
_NCCL_VERSION = re.compile(r"NCCL version (?P<version>[\w.+-]+)")
_EVIDENCE = re.compile(
    r"NCCL version|Using network|NET/OFI Selected provider|NET/Socket : Using|NET/Plugin|"
    r"GPU Direct RDMA|via NET/",
    re.IGNORECASE,
)
_NETWORK_CHOICE = re.compile(r"via NET/|Using network|Selected provider|NET/Socket : Using", re.IGNORECASE)
_LIBFABRIC_NAMES = ("Libfabric", "AWS Libfabric", "OFI")
# Ranking used to combine ranks: the weakest network any rank used is what the job got.
_STRENGTH = {Transport.SOCKET: 0, Transport.UNKNOWN: 1, Transport.EFA: 2, Transport.EFA_GPUDIRECT: 3}
_MAX_EVIDENCE_PER_RANK = 6


@dataclass
class RankTransport:
    """What one rank's NCCL log shows."""

    network_channels: set[Transport] = field(default_factory=set)  # from "via NET/..." channel lines
    announced: Transport | None = None  # from "Using network ..."
    evidence: list[str] = field(default_factory=list)
    nccl_version: str | None = None


def parse_nccl_log(lines: Iterable[str]) -> RankTransport:
    result = RankTransport()
    provider: str | None = None  # the libfabric provider, which may be logged after the network name
    announced: str | None = None
    libfabric_channels: list[bool] = []  # GPUDirect flag per Libfabric channel line
    for raw in lines:
        line = raw.strip()
        if not _EVIDENCE.search(line):
            continue
        message = line.split("NCCL INFO", 1)[-1].strip()
        if message not in result.evidence and (
            len(result.evidence) < _MAX_EVIDENCE_PER_RANK or "via NET/" not in message
        ):
            result.evidence.append(message)
        if version := _NCCL_VERSION.search(line):
            result.nccl_version = version["version"]
        if found := _OFI_PROVIDER.search(line):
            provider = found["provider"].lower()
        if channel := _CHANNEL.search(line):
            if channel["net"] in _LIBFABRIC_NAMES:
                libfabric_channels.append(channel["gdr"] is not None)
            elif channel["net"] == "Socket":
                result.network_channels.add(Transport.SOCKET)
            else:  # InfiniBand or another plugin: not a network this product knows how to judge
                result.network_channels.add(Transport.UNKNOWN)
        elif using := _USING_NETWORK.search(line):
            announced = using["net"]
    for gpudirect in libfabric_channels:
        result.network_channels.add(_libfabric(provider, gpudirect))
    if announced is not None:
        result.announced = _network_name(announced, provider)
    return result


def _network_name(name: str, provider: str | None) -> Transport:
    if name == "Socket":
        return Transport.SOCKET
    if name in _LIBFABRIC_NAMES:
        return _libfabric(provider, gpudirect=False)
    return Transport.UNKNOWN


def _libfabric(provider: str | None, gpudirect: bool) -> Transport:
    """Libfabric is EFA only with the efa provider; its tcp/sockets providers are TCP in disguise."""
    if provider is not None and provider != "efa":
        return Transport.SOCKET
    return Transport.EFA_GPUDIRECT if gpudirect else Transport.EFA


def combine(ranks: list[RankTransport], nodes: int) -> TransportReport:
    """The job's transport: single-node when all ranks share a node, else the weakest network any rank
    used for its inter-node channels (falling back to the announced network when no channel lines exist)."""
    evidence = [line for rank in ranks for line in rank.evidence]
    deduplicated = list(dict.fromkeys(evidence))
    if nodes <= 1:
        return TransportReport(observed=Transport.SINGLE, evidence=deduplicated)
    seen = {transport for rank in ranks for transport in rank.network_channels}
    if not seen:
        seen = {rank.announced for rank in ranks if rank.announced is not None}
    observed = min(seen, key=_STRENGTH.__getitem__) if seen else Transport.UNKNOWN
    return TransportReport(observed=observed, evidence=deduplicated)


def enforce(policy: EfaPolicy, report: TransportReport) -> None:
    """With EFA required, anything but EFA stops the run (before any training time is spent)."""
    # Contract models store enum values as plain strings, hence == rather than `is`.
    if policy != EfaPolicy.REQUIRED or report.observed in (Transport.EFA, Transport.EFA_GPUDIRECT):
        return
    if report.observed == Transport.SINGLE:
        return  # nothing crossed a node boundary, so no network was used or needed
    telling = [line for line in report.evidence if _NETWORK_CHOICE.search(line)]
    raise TransportError(
        f"network.efa is required but the collectives used {report.observed}; "
        f"evidence: {telling[:4]}. Check that the pods request vpc.amazonaws.com/efa, that the "
        "aws-ofi-nccl plugin is on LD_LIBRARY_PATH and FI_PROVIDER=efa."
    )


def bus_bandwidth_gbps(size_bytes: int, world_size: int, seconds: float) -> float:
    """All-reduce bus bandwidth as nccl-tests defines it: algbw * 2 * (n - 1) / n, in GB/s (1e9)."""
    if world_size < 2 or seconds <= 0:
        return 0.0
    return size_bytes * 2 * (world_size - 1) / world_size / seconds / 1e9


# ----------------------------------------------------------------------------------------------------------
# Worker environment and log files


def nccl_log_pattern(run_name: str) -> str:
    """NCCL_DEBUG_FILE value; NCCL expands %h (host) and %p (pid), so every rank writes its own file."""
    return os.path.join(NCCL_LOG_DIR, f"fsdp-nccl-{run_name}.%h.%p.log")


def worker_env(network: NetworkSpec, run_name: str) -> dict[str, str]:
    """Environment for GPU workers, set before NCCL initialises: logging for the evidence, the EFA
    provider unless EFA is disabled, then the user's own NCCL_*/FI_* settings, which win."""
    env = {
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,NET",
        "NCCL_DEBUG_FILE": nccl_log_pattern(run_name),
    }
    if network.efa != EfaPolicy.DISABLED:
        env["FI_PROVIDER"] = "efa"
    env.update(network.nccl_env)
    return env


CUDA_ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


def allocator_env() -> dict[str, str]:
    """The CUDA caching allocator's settings for GPU workers, read once as CUDA initialises: expandable
    segments (as torchtitan's launcher sets), which grow a segment in place rather than cache fixed-size
    blocks, so memory freed as shapes change is not stranded as fragments. Nothing when this process's
    environment (the run's: the job's runtime env) sets the variable: the user's value is never replaced."""
    return {} if CUDA_ALLOC_CONF in os.environ else {CUDA_ALLOC_CONF: "expandable_segments:True"}


SOCKET_INTERFACE = "eth0"  # the pod's VPC interface; AWS's EKS manifests set NCCL_SOCKET_IFNAME to it
NET_DEVICES = "/sys/class/net"


def choose_socket_interface(net_devices: str = NET_DEVICES) -> str:
    """Sets NCCL_SOCKET_IFNAME to eth0 where the run left it unset and this pod has an eth0, so that NCCL's
    bootstrap and socket transport never pick the pod-identity link (169.254.170.x), which hangs across
    nodes (aws-samples/aws-do-eks#54). Returns what the transport report records: the interface and why."""
    chosen = os.environ.get("NCCL_SOCKET_IFNAME")
    if chosen is not None:
        return f"NCCL_SOCKET_IFNAME={chosen} (set for the run)"
    if os.path.isdir(os.path.join(net_devices, SOCKET_INTERFACE)):
        os.environ["NCCL_SOCKET_IFNAME"] = SOCKET_INTERFACE
        return f"NCCL_SOCKET_IFNAME={SOCKET_INTERFACE} (the trainer's default where the pod has it, as AWS's)"
    return f"NCCL_SOCKET_IFNAME unset: this pod has no {SOCKET_INTERFACE}, NCCL chooses the interface"


def own_nccl_log_lines(run_name: str) -> list[str]:
    """This process's NCCL log (found by pid: NCCL's %h may shorten the host name)."""
    pattern = os.environ.get("NCCL_DEBUG_FILE") or nccl_log_pattern(run_name)
    candidates = glob.glob(pattern.replace("%h", "*").replace("%p", str(os.getpid())))
    lines: list[str] = []
    for path in candidates:
        with open(path, errors="replace") as log_file:
            lines.extend(log_file)
    return lines


# ----------------------------------------------------------------------------------------------------------
# Measuring, on every rank


def measure(
    network: NetworkSpec,
    run_name: str,
    runtime: distributed.Runtime,
    versions: Versions,
    socket_interface: str | None = None,
    bus_bandwidth_gbps: float | None = None,
) -> TransportReport:
    """The network every rank's NCCL log shows (NCCL has initialised: the fabric check's collectives came
    first), with the pods that fell back to sockets and the fabric check's bus bandwidth; the EFA policy is
    the fabric check's to enforce. Records the NCCL version in `versions`, and `socket_interface`
    (choose_socket_interface's line) in the evidence."""
    if runtime.backend != "nccl":
        return TransportReport(
            observed=Transport.GLOO,
            evidence=[f"torch.distributed backend {runtime.backend} on {runtime.device.type}"],
            bus_bandwidth_gbps=bus_bandwidth_gbps,
        )
    mine = parse_nccl_log(own_nccl_log_lines(run_name))
    if socket_interface is not None:  # after NCCL's own lines, which the operator quotes first
        mine.evidence.append(socket_interface)
    gathered = distributed.all_gather((os.uname().nodename, mine))
    nodes = len({host for host, _ in gathered})
    report = combine([rank_report for _, rank_report in gathered], nodes)
    report.bus_bandwidth_gbps = bus_bandwidth_gbps
    if nodes > 1:
        report.fallback_pods = sorted({host for host, rank in gathered if _used_sockets(rank)})
    if mine.nccl_version:
        versions.nccl = mine.nccl_version
    log.info("transport: %s over %d node(s)", report.observed, nodes)
    return report


def _used_sockets(rank: RankTransport) -> bool:
    if rank.network_channels:
        return Transport.SOCKET in rank.network_channels
    return rank.announced == Transport.SOCKET
