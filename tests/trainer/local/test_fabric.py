"""The fabric check (issue 36 item 1): the verdict against the threshold, the pod every slow link touches,
and the check itself in a gloo group of three processes standing for three pods."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as multiprocessing

from fsdp_trainer import distributed, fabric
from fsdp_trainer.contract import ErrorKind, FabricLink, FabricPod, NetworkSpec, SweepPoint, Versions
from fsdp_trainer.errors import FabricError, classify
from tests.support.net import free_port

pytestmark = pytest.mark.unit

PODS = [FabricPod(pod=f"w{index}", node=f"node-{index}", ranks=[index]) for index in range(3)]
SWEEP = [SweepPoint(size_bytes=64 << 20, bus_bandwidth_gbps=40.0, seconds=0.01)]


def links(**slow: float) -> list[FabricLink]:
    """Every ordered pair of the three pods at 50 GB/s, except those named source_target=GB/s."""
    return [
        FabricLink(source_pod=a, target_pod=b, gbps=slow.get(f"{a}_{b}", 50.0))
        for a in ("w0", "w1", "w2")
        for b in ("w0", "w1", "w2")
        if a != b
    ]


def judged(
    threshold: float | None, links_: list[FabricLink], pods: list[FabricPod] = PODS, bus: float = 40.0
):
    sweep = [SWEEP[0].model_copy(update={"bus_bandwidth_gbps": bus})]
    return fabric.judge(threshold, pods, sweep, links_, backend="nccl", transport_used="efa", libraries=[])


def test_a_healthy_fabric_passes_with_its_figures() -> None:
    report = judged(20.0, links())
    assert report.passed and report.suspect_pod is None
    assert "bus bandwidth 40 GB/s at 64 MiB over 3 pod(s) >= 20 GB/s required" in report.message


def test_slow_links_into_one_pod_name_that_pod_and_its_node() -> None:
    report = judged(20.0, links(w0_w1=0.5, w2_w1=0.4), bus=0.9)
    assert not report.passed
    assert (report.suspect_pod, report.suspect_node) == ("w1", "node-1")
    assert "every slow link touches pod w1 on node node-1" in report.message
    assert "w0 -> w1 0.5 GB/s" in report.message


def test_a_uniformly_slow_fabric_fails_without_blaming_a_pod() -> None:
    report = judged(20.0, links(**{f"{a}_{b}": 1.0 for a in ["w0", "w1", "w2"] for b in ["w0", "w1", "w2"]}))
    assert not report.passed and report.suspect_pod is None
    assert "no single pod to blame" in report.message


def test_between_two_pods_a_slow_link_has_no_single_culprit() -> None:
    two = PODS[:2]
    pair = [
        FabricLink(source_pod="w0", target_pod="w1", gbps=0.5),
        FabricLink(source_pod="w1", target_pod="w0", gbps=50),
    ]
    report = judged(20.0, pair, pods=two)
    assert not report.passed and report.suspect_pod is None


def test_a_low_bus_bandwidth_alone_fails_the_check() -> None:
    assert not judged(20.0, links(), bus=5.0).passed


def test_without_a_threshold_the_figures_are_recorded_not_judged() -> None:
    report = judged(None, links(w0_w1=0.001), bus=0.001)
    assert report.passed and "no threshold (network.minBusBandwidthGbps)" in report.message


def test_one_pod_has_no_fabric_to_judge() -> None:
    report = judged(20.0, [], pods=PODS[:1], bus=0.001)
    assert report.passed and "one pod" in report.message


def test_a_failed_check_is_the_fabric_error_kind() -> None:
    with pytest.raises(FabricError) as raised:
        fabric.raise_if_failed(judged(20.0, links(w0_w1=0.5, w2_w1=0.4)))
    assert classify(raised.value) == ErrorKind.FABRIC


def test_pods_are_listed_in_order_of_their_first_rank() -> None:
    layout = fabric.pod_layout([("b", "n2", 3), ("a", "n1", 1), ("b", "n2", 2), ("a", "n1", 0)])
    assert [(pod.pod, pod.ranks) for pod in layout] == [("a", [0, 1]), ("b", [2, 3])]


def test_network_libraries_are_read_from_the_process_maps() -> None:
    maps = "\n".join(
        [
            "7f00-7f01 r-xp 0 00:00 1 /opt/amazon/efa/lib/libfabric.so.1.25.0",
            "7f01-7f02 r-xp 0 00:00 1 /opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so",
            "7f02-7f03 r-xp 0 00:00 1 /usr/lib/x86_64-linux-gnu/libc.so.6",
            "7f03-7f04 rw-p 0 00:00 0 [heap]",
        ]
    )
    assert fabric.loaded_network_libraries(read=lambda path: maps) == [
        "libfabric.so.1.25.0",
        "libnccl-net-ofi.so",
    ]


def check_on_rank(rank: int, port: int, threshold: float, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    try:
        runtime = distributed.Runtime("single", rank, 3, 0, 1, torch.device("cpu"))
        network = NetworkSpec(bandwidth_probe_mb=4, min_bus_bandwidth_gbps=threshold)
        report, transport_report = fabric.check(
            network, "run", runtime, Versions(), pod=f"pod-{rank}", node=f"node-{rank}"
        )
        Path(out, f"rank-{rank}.json").write_text(json.dumps([report.to_json(), transport_report.to_json()]))
    finally:
        dist.destroy_process_group()


def run_check(tmp_path: Path, threshold: float) -> list[dict]:
    multiprocessing.spawn(check_on_rank, args=(free_port(), threshold, str(tmp_path)), nprocs=3, join=True)
    return [json.loads(json.loads((tmp_path / f"rank-{rank}.json").read_text())[0]) for rank in range(3)]


def test_three_pods_measure_every_link_and_agree_on_the_verdict(tmp_path: Path) -> None:
    reports = run_check(tmp_path, threshold=1e-6)
    first = reports[0]
    same = [{key: value for key, value in report.items() if key != "seconds"} for report in reports]
    assert all(report == same[0] for report in same), "every rank must reach the same figures and verdict"
    assert first["passed"] and first["backend"] == "gloo" and first["transport"] == "gloo"
    assert [pod["pod"] for pod in first["pods"]] == ["pod-0", "pod-1", "pod-2"]
    pairs = {(link["sourcePod"], link["targetPod"]) for link in first["links"]}
    assert pairs == {(f"pod-{a}", f"pod-{b}") for a in range(3) for b in range(3) if a != b}
    assert all(link["gbps"] > 0 for link in first["links"])
    assert first["sweep"][0]["sizeBytes"] == 1 << 20 and first["busBandwidthGbps"] > 0
    assert 0 < first["seconds"] < 30


def test_an_unreachable_threshold_fails_every_rank_alike(tmp_path: Path) -> None:
    reports = run_check(tmp_path, threshold=1e6)
    assert all(not report["passed"] for report in reports)
    assert all(report["message"] == reports[0]["message"] for report in reports)
    assert "1e+06 GB/s required" in reports[0]["message"]


def test_efa_required_and_one_pod_on_sockets_blames_that_pod_for_the_policy_to_avoid() -> None:
    from fsdp_trainer.contract import EfaPolicy, TransportReport

    passed = judged(20.0, links())
    used = TransportReport(observed="socket", fallback_pods=["w1"])
    report = fabric.judge_transport(passed, EfaPolicy.REQUIRED, used)
    assert not report.passed and (report.suspect_pod, report.suspect_node) == ("w1", "node-1")
    assert "NCCL used TCP sockets on w1 (node node-1) while the other pods used EFA" in report.message
    two = fabric.judge_transport(
        judged(20.0, links()), EfaPolicy.REQUIRED, used.model_copy(update={"fallback_pods": ["w1", "w2"]})
    )
    assert not two.passed and two.suspect_pod is None and "no single one to blame" in two.message
    preferred = fabric.judge_transport(judged(20.0, links()), EfaPolicy.PREFERRED, used)
    assert preferred.passed, "preferred reports a fallback (TransportDegraded), it does not fail"


def test_efa_required_and_every_pod_on_sockets_is_the_configurations_and_fails_the_run() -> None:
    from fsdp_trainer.contract import EfaPolicy, TransportReport
    from fsdp_trainer.errors import TransportError

    everyone = TransportReport(observed="socket", fallback_pods=["w0", "w1", "w2"])
    with pytest.raises(TransportError):
        fabric.judge_transport(judged(20.0, links()), EfaPolicy.REQUIRED, everyone)
    on_efa = fabric.judge_transport(
        judged(20.0, links()), EfaPolicy.REQUIRED, TransportReport(observed="efa")
    )
    assert on_efa.passed


def test_the_transport_report_names_the_pods_that_fell_back_to_sockets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fsdp_trainer import transport
    from fsdp_trainer.contract import EfaPolicy

    efa = transport.parse_nccl_log(
        [
            "h:1:1 [0] NCCL INFO NET/OFI Selected provider is efa",
            "h:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/Libfabric/0/GDRDMA",
        ]
    )
    sockets = transport.parse_nccl_log(
        ["h:1:1 [0] NCCL INFO Channel 00/0 : 8[0] -> 0[0] [send] via NET/Socket/0"]
    )
    monkeypatch.setattr(transport, "own_nccl_log_lines", lambda run_name: [])
    monkeypatch.setattr(
        transport.distributed, "all_gather", lambda value: [("pod-a", efa), ("pod-b", sockets)]
    )
    monkeypatch.setattr(distributed.Runtime, "backend", property(lambda self: "nccl"))
    runtime = distributed.Runtime("single", 0, 2, 0, 1, torch.device("cpu"))
    report = transport.measure(NetworkSpec(efa=EfaPolicy.REQUIRED), "run", runtime, Versions())
    assert report.observed == "socket" and report.fallback_pods == ["pod-b"]
