"""The tests' local Ray nodes: one whose `ray start` exits before the node has started (as one that misses
Ray's fixed 30 s to register with the GCS under load does) is started again, and its exited log is kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import ray_nodes


def test_a_node_whose_ray_start_exits_before_starting_is_started_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    failed_once = tmp_path / "failed-once"
    # `ray start` for a worker node exits the first time as Ray's does when its raylet misses the GCS
    # registration deadline; the head and every later start are Ray's own.
    flaky_ray = tmp_path / "ray"
    flaky_ray.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = start ] && ! echo "$*" | grep -q -- --head && [ ! -e {failed_once} ]; then\n'
        f"  touch {failed_once}\n"
        '  echo "Failed to get the node info: Deadline Exceeded"\n'
        "  exit 1\n"
        "fi\n"
        f'exec {ray_nodes.RAY} "$@"\n'
    )
    flaky_ray.chmod(0o755)
    monkeypatch.setattr(ray_nodes, "RAY", flaky_ray)
    logs = tmp_path / "logs"
    logs.mkdir()
    with ray_nodes.local_ray_cluster(logs, {}, "--num-cpus=0") as cluster:
        (node,) = cluster.start_nodes(1, "--num-cpus=1")
        assert failed_once.exists(), "the first worker start was not the failing one"
        assert node.poll() is None, "the node started again is not running"
        assert "Ray runtime started" in (logs / "node-1.log").read_text()
        exited = logs / "node-1.exited-1.log"
        assert "Deadline Exceeded" in exited.read_text(), f"the exited attempt's log was not kept at {exited}"
        assert cluster.nodes == [cluster.nodes[0], node], "the exited attempt is still counted as a node"
