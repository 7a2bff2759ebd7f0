"""The local control plane's processes, killed and started again as a supervisor would."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.support.paths import state_dir
from tests.support.waiting import wait_until


@dataclass(frozen=True)
class ControlPlaneComponent:
    """One process of the local control plane as kwokctl runs it (binary, arguments, working directory, pid
    and log files), to kill with SIGKILL and start again exactly as it was."""

    name: str
    command: list[str]
    work_dir: Path

    @classmethod
    def all_of_local_cluster(cls) -> list[ControlPlaneComponent]:
        [cluster] = (state_dir() / "kwok" / "clusters").iterdir()
        documents = yaml.safe_load_all((cluster / "kwok.yaml").read_text())
        return [
            cls(c["name"], [c["binary"], *c.get("args", [])], Path(c["workDir"]))
            for doc in documents
            for c in (doc or {}).get("components", [])
        ]

    @classmethod
    def of_local_cluster(cls, name: str) -> ControlPlaneComponent:
        [found] = [c for c in cls.all_of_local_cluster() if c.name == name]
        return found

    def running(self) -> bool:
        return Path(f"/proc/{int(self.pid_file.read_text())}").exists()

    @property
    def pid_file(self) -> Path:
        return self.work_dir / "pids" / f"{self.name}.pid"

    def kill(self) -> None:
        os.kill(int(self.pid_file.read_text()), 9)
        wait_until(f"{self.name} to die", lambda: not self.running(), timeout=30)

    def start(self) -> None:
        """Starts it again, detached, with its pid where kwokctl (and cluster-down) look for it."""
        with (self.work_dir / "logs" / f"{self.name}.log").open("ab") as log:
            process = subprocess.Popen(
                self.command, cwd=self.work_dir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.pid_file.write_text(str(process.pid))


def restart_exited_control_plane() -> list[str]:
    """Starts again every control-plane process that has exited, as its supervisor (systemd, a kubelet) would:
    kube-controller-manager and kube-scheduler exit when an apiserver outage costs them their leader lease."""
    exited = [c for c in ControlPlaneComponent.all_of_local_cluster() if not c.running()]
    for component in exited:
        component.start()
    return [c.name for c in exited]
