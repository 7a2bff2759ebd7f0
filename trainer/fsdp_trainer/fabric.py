"""The fabric check: before an attempt's first step, on the attempt's own pods and image, is the network
between the pods what the run needs, and if not, which pod's link is to blame?

Every rank takes part, with the backend initialised as training uses it:
- an all-reduce sweep, doubling from 1 MiB up to network.bandwidthProbeMb within SWEEP_BUDGET_SECONDS, giving
  bus bandwidth per size (nccl-tests' busbw);
- a link test: every pod sends to its next pod at once, then to its previous one; the bandwidth each pod
  receives at is that link's. A slow link slows only its own receiver, so the links below the threshold
  name the pod they all touch (with three pods or more; between two pods a slow link has no single culprit);
- the transport NCCL chose (transport.measure) and, on GPU workers, the network libraries loaded.
The verdict (`judge`) is pure: the figures against network.minBusBandwidthGbps.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from fsdp_trainer import distributed, transport
from fsdp_trainer.contract import (
    EfaPolicy,
    FabricLink,
    FabricPod,
    FabricReport,
    NetworkSpec,
    SweepPoint,
    TransportReport,
    Versions,
)
from fsdp_trainer.errors import FabricError

log = logging.getLogger(__name__)

MIB = 1 << 20
SWEEP_BUDGET_SECONDS = 3.0
SWEEP_ITERATIONS = 3
LINK_ITERATIONS = 2
LINK_BYTES_LIMIT = 64 * MIB  # per rank and direction: enough to fill a link, short on a healthy fabric
# Shared objects whose presence in the process proves which network stack NCCL loaded (aws-ofi-nccl ships
# libnccl-net-ofi.so, older releases libnccl-net.so; libfabric carries the efa provider).
NETWORK_LIBRARIES = ("libfabric.so", "libnccl-net", "libnccl.so", "libefa.so")
PROC_MAPS = "/proc/self/maps"


def check(
    network: NetworkSpec,
    run_name: str,
    runtime: distributed.Runtime,
    versions: Versions,
    socket_interface: str | None = None,
    pod: str = "",
    node: str | None = None,
) -> tuple[FabricReport, TransportReport]:
    """Measures and judges, with this rank's pod (default: the host name) and node; returns the fabric
    report and the transport's. Raises TransportError when every pod fell back to sockets against the EFA
    policy; a failed verdict (pods below the threshold, or some pods on sockets against it) is the caller's
    to record, then raise (raise_if_failed)."""
    started = time.perf_counter()
    pods = pod_layout(distributed.all_gather((pod or socket.gethostname(), node, runtime.rank)))
    probing = runtime.world_size > 1 and network.bandwidth_probe_mb > 0
    sweep = _sweep(network.bandwidth_probe_mb * MIB, runtime.device) if probing else []
    transport_report = transport.measure(
        network,
        run_name,
        runtime,
        versions,
        socket_interface,
        bus_bandwidth_gbps=sweep[-1].bus_bandwidth_gbps if sweep else None,
    )
    links = _links(pods, runtime, sweep[-1].size_bytes) if probing and len(pods) > 1 else []
    report = judge(
        network.min_bus_bandwidth_gbps,
        pods,
        sweep,
        links,
        backend=runtime.backend,
        transport_used=transport_report.observed,
        libraries=loaded_network_libraries() if runtime.device.type == "cuda" else [],
    )
    report = judge_transport(report, network.efa, transport_report)
    report.seconds = round(time.perf_counter() - started, 3)
    log.info("fabric check (%.1f s): %s", report.seconds, report.message)
    return report, transport_report


def raise_if_failed(report: FabricReport) -> None:
    if not report.passed:
        raise FabricError(report.message)


def judge(
    threshold: float | None,
    pods: list[FabricPod],
    sweep: list[SweepPoint],
    links: list[FabricLink],
    backend: str,
    transport_used: str,
    libraries: list[str],
) -> FabricReport:
    """The verdict: passed unless a threshold is set, the run spans two pods or more, and the bus bandwidth
    or a link is below it. The suspect is the one pod every slow link touches, when there is one."""
    bus = sweep[-1].bus_bandwidth_gbps if sweep else None
    report = FabricReport(
        backend=backend,
        transport=transport_used,
        libraries=libraries,
        pods=pods,
        sweep=sweep,
        links=links,
        bus_bandwidth_gbps=bus,
        min_bus_bandwidth_gbps=threshold,
    )
    measured = f"bus bandwidth {_gbps(bus)} GB/s" if bus is not None else "no bandwidth measured"
    if sweep:
        measured += f" at {sweep[-1].size_bytes // MIB} MiB over {len(pods)} pod(s)"
    if len(pods) < 2:
        report.message = f"{measured}; one pod: no network between pods to judge"
        return report
    if threshold is None:
        report.message = f"{measured}; no threshold (network.minBusBandwidthGbps) to judge it against"
        return report
    slow = [link for link in links if link.gbps < threshold]
    if (bus is None or bus >= threshold) and not slow:
        report.message = f"{measured} >= {_gbps(threshold)} GB/s required; slowest link " + (
            _link_text(min(links, key=lambda link: link.gbps)) if links else "not measured"
        )
        return report
    report.passed = False
    suspect = _suspect(pods, slow)
    if suspect is not None:
        report.suspect_pod, report.suspect_node = suspect.pod, suspect.node
    below = "; ".join(_link_text(link) for link in slow[:4]) or "no single link below it"
    blame = (
        f"every slow link touches pod {suspect.pod}" + (f" on node {suspect.node}" if suspect.node else "")
        if suspect is not None
        else "no single pod to blame (the slow links share none, or there are only two pods)"
    )
    report.message = f"{measured}, {_gbps(threshold)} GB/s required; slow links: {below}; {blame}"
    return report


def judge_transport(report: FabricReport, policy: EfaPolicy, used: TransportReport) -> FabricReport:
    """The EFA policy: with EFA required, pods of one run that fell back to TCP sockets while others used EFA
    are a node's problem (its EFA device or plugin): the check fails naming them, and the run's slowFabric
    policy decides. Every pod on sockets is the configuration's: TransportError, the run fails."""
    fallen = used.fallback_pods
    if policy != EfaPolicy.REQUIRED or not fallen or len(fallen) >= len(report.pods):
        transport.enforce(policy, used)
        return report
    nodes = {pod.pod: pod.node for pod in report.pods}
    report.passed = False
    if len(fallen) == 1:
        report.suspect_pod, report.suspect_node = fallen[0], nodes.get(fallen[0])
    named = ", ".join(f"{pod}" + (f" (node {nodes[pod]})" if nodes.get(pod) else "") for pod in fallen[:4])
    alone = "" if len(fallen) == 1 else "; more than one pod: no single one to blame"
    report.message = (
        f"network.efa is required but NCCL used TCP sockets on {named} while the other pods used EFA{alone}"
        + (f"; {report.message}" if report.message else "")
    )
    return report


def _suspect(pods: list[FabricPod], slow: list[FabricLink]) -> FabricPod | None:
    if len(pods) < 3 or not slow:
        return None
    shared = set.intersection(*({link.source_pod, link.target_pod} for link in slow))
    if len(shared) != 1:
        return None
    (name,) = shared
    return next(pod for pod in pods if pod.pod == name)


def pod_layout(ranks: Sequence[tuple[str, str | None, int]]) -> list[FabricPod]:
    """The pods in order of their first rank, from every rank's (host, node, rank)."""
    pods: dict[str, FabricPod] = {}
    for host, node, rank in sorted(ranks, key=lambda entry: entry[2]):
        pods.setdefault(host, FabricPod(pod=host, node=node)).ranks.append(rank)
    return list(pods.values())


def _sweep(largest_bytes: int, device: torch.device) -> list[SweepPoint]:
    world = dist.get_world_size()
    points: list[SweepPoint] = []
    size, spent = MIB, 0.0
    warm = torch.ones(1, device=device)
    dist.all_reduce(warm)  # connection setup is not bandwidth
    while True:
        buffer = torch.ones(size // 4, dtype=torch.float32, device=device)
        _synchronize(device)
        start = time.perf_counter()
        for _ in range(SWEEP_ITERATIONS):
            dist.all_reduce(buffer)
        _synchronize(device)
        elapsed = time.perf_counter() - start
        # The slowest rank's time is the collective's; every rank then agrees on whether to go on.
        elapsed = distributed.maximum(elapsed, device)
        seconds = elapsed / SWEEP_ITERATIONS
        bandwidth = transport.bus_bandwidth_gbps(size, world, seconds)
        points.append(SweepPoint(size_bytes=size, bus_bandwidth_gbps=_round(bandwidth), seconds=seconds))
        spent += elapsed
        if size * 2 > largest_bytes or spent + 2 * elapsed > SWEEP_BUDGET_SECONDS:
            return points
        size *= 2


def _links(pods: list[FabricPod], runtime: distributed.Runtime, sweep_bytes: int) -> list[FabricLink]:
    """Every pod to its next pod, then (three pods or more) to its previous one, one pair at a time so that
    each link's time is its own. Each rank sends to the rank of its local index on the other pod, and a
    link's bandwidth is the sum over those ranks (each GPU has its own NICs on EFA instances)."""
    size = max(MIB, min(sweep_bytes, LINK_BYTES_LIMIT))
    shifts = (1,) if len(pods) == 2 else (1, -1)  # between two pods, one shift already covers both ways
    received: list[tuple[int, int, float]] = []  # (source rank, target rank, GB/s), measured here
    for shift in shifts:
        for index, source_pod in enumerate(pods):
            target_pod = pods[(index + shift) % len(pods)]
            dist.barrier()  # one link at a time
            for source, target in zip(source_pod.ranks, target_pod.ranks, strict=False):
                if runtime.rank == source:
                    _transfer(dist.isend, target, size, runtime.device)
                elif runtime.rank == target:
                    seconds = _transfer(dist.irecv, source, size, runtime.device)
                    received.append((source, target, size * LINK_ITERATIONS / seconds / 1e9))
    pod_of = {rank: pod.pod for pod in pods for rank in pod.ranks}
    totals: dict[tuple[str, str], float] = {}
    for entries in distributed.all_gather(received):
        for source, target, gbps in entries:
            key = (pod_of[source], pod_of[target])
            totals[key] = totals.get(key, 0.0) + gbps
    return [
        FabricLink(source_pod=source, target_pod=target, gbps=_round(gbps))
        for (source, target), gbps in totals.items()
    ]


def _transfer(
    operation: Callable[..., dist.Work | None], peer: int, size: int, device: torch.device
) -> float:
    """One small untimed exchange (it sets the pair's connection up), then LINK_ITERATIONS of `size` bytes;
    the seconds those took. Batched point-to-point: NCCL runs a batch on the group's own communicator, where
    a lone isend/irecv would create a two-rank communicator for the pair, kept (with its buffers and
    connections) for the rest of the run. In ProcessGroupNCCL::pointToPoint (ProcessGroupNCCL.cpp),
    `batchP2P = ncclActiveGroupCounter_ > 0` (set by batch_isend_irecv's coalescing, distributed_c10d.py
    lines 3049-3060 in torch 2.13) takes the device's key (`getKeyFromDevice`), the one the group's
    collectives use; a lone send/recv takes `getKeySendRecv(rank_, peer)`, "low:high", and initNCCLComm makes
    that pair's communicator on first use. torch 2.13's ProcessGroupNCCL.hpp (lines 1335-1342) keeps both
    kinds in one map, devNCCLCommMap_, left only when the group is aborted or shut down. Only
    eager initialisation (init_process_group(device_id=...), `eagerInit_`, line 1129) sends lone P2P to the
    group's communicator too; neither distributed.start nor Ray Train (2.58) passes a device_id. Since
    only a link's two ranks enter its batch, the world communicator must exist before the first one
    (batch_isend_irecv's docstring): the sweep's all-reduce, always run first, has built it.
    tests/trainer/local/test_fabric_communicators.py checks the calls; the communicators need two GPUs."""
    _exchange(operation, [torch.ones(1, device=device)], peer, device)
    buffers = [torch.ones(size // 4, dtype=torch.float32, device=device) for _ in range(LINK_ITERATIONS)]
    start = time.perf_counter()
    _exchange(operation, buffers, peer, device)
    return time.perf_counter() - start


def _exchange(
    operation: Callable[..., dist.Work | None], buffers: list[torch.Tensor], peer: int, device: torch.device
) -> None:
    for work in dist.batch_isend_irecv([dist.P2POp(operation, buffer, peer) for buffer in buffers]):
        work.wait()
    _synchronize(device)


def loaded_network_libraries(maps: str = PROC_MAPS, read: Callable[[str], str] | None = None) -> list[str]:
    """The network libraries mapped into this process (its /proc/self/maps), by file name."""
    try:
        text = read(maps) if read is not None else open(maps).read()  # noqa: SIM115 - one short read
    except OSError:
        return []
    names = {os.path.basename(line.split()[-1]) for line in text.splitlines() if "/" in line}
    return sorted(name for name in names if name.startswith(NETWORK_LIBRARIES))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _round(gbps: float) -> float:
    return round(gbps, 4)


def _gbps(value: float | None) -> str:
    return "?" if value is None else f"{value:.3g}"


def _link_text(link: FabricLink) -> str:
    return f"{link.source_pod} -> {link.target_pod} {_gbps(link.gbps)} GB/s"
