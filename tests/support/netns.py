"""A server that binds every interface (no address setting), run in a network namespace of its own so that
nothing outside it can reach what it opens, with only the loopback ports it needs carried across.

Inside (`unshare --net`, the filesystem shared) the process reaches the apiserver at the kubeconfig's
127.0.0.1:PORT, and its served port, where it has one the host needs, is reached at the host's 127.0.0.1
under the same number: socat carries each through a unix socket in a short-named directory of the host's /tmp.
Karpenter (metrics and health on ":8080", ":8081") and the pod identity webhook run this way.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

from tests.support.processes import stop_process, stop_process_group
from tests.support.waiting import wait_until

_LAUNCH = r"""
set -eu
apiserver_port=$1 apiserver_socket=$2 served_port=$3 served_socket=$4; shift 4
ip link set lo up
socat "TCP-LISTEN:$apiserver_port,bind=127.0.0.1,fork,reuseaddr" "UNIX-CONNECT:$apiserver_socket" &
if [ -n "$served_port" ]; then
  socat "UNIX-LISTEN:$served_socket,fork,mode=600" "TCP:127.0.0.1:$served_port" &
fi
for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$apiserver_port") 2>/dev/null && break; sleep 0.1; done
exec "$@"
"""


def _socat(*addresses: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["socat", *addresses], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@contextmanager
def in_network_namespace(
    argv: Sequence[str],
    log: Path,
    apiserver_port: int,
    served_port: int | None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """`argv` in a network namespace of its own until the block ends, reaching the apiserver on loopback and,
    with a `served_port`, served on the host's 127.0.0.1:`served_port`; then it and every forwarder are
    stopped by pid."""
    sockets = Path(tempfile.mkdtemp(prefix="netns-"))  # a unix socket's path is at most 107 bytes
    apiserver_socket, served_socket = sockets / "apiserver.sock", sockets / "served.sock"
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, sockets, ignore_errors=True)
        inward = _socat(f"UNIX-LISTEN:{apiserver_socket},fork,mode=600", f"TCP:127.0.0.1:{apiserver_port}")
        stack.callback(stop_process, inward)
        if served_port is not None:
            outward = _socat(
                f"TCP-LISTEN:{served_port},bind=127.0.0.1,fork,reuseaddr", f"UNIX-CONNECT:{served_socket}"
            )
            stack.callback(stop_process, outward)
        wait_until(
            f"socat listening on {apiserver_socket}", apiserver_socket.exists, timeout=10, interval=0.1
        )
        out = stack.enter_context(log.open("ab"))
        process = subprocess.Popen(
            ["unshare", "--net", "--", "bash", "-c", _LAUNCH, argv[0],
             str(apiserver_port), str(apiserver_socket), str(served_port or ""), str(served_socket), *argv],
            env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        stack.callback(stop_process_group, process)  # the process and the namespace's two socats
        yield process
