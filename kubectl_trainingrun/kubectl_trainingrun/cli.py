"""kubectl-trainingrun: `kubectl trainingrun logs|describe|plot RUN` and `diff RUN_A RUN_B` for the people
who train.

kubectl finds this program on PATH and hands it the arguments after `trainingrun`. The run is read through
kubectl itself (`kubectl get -o json`), so -n, --context, --kubeconfig, the kubeconfig's namespace and its
credential plugins behave as they do for every kubectl command. S3 is read with boto3's default credential
chain: the user's own AWS identity, never the operator's.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from fsdp_client import logs as run_logs
from fsdp_client import plot, rundiff
from fsdp_client.errors import ClientError, NotRecordedYet
from fsdp_client.storage import RunObjects, metric_histories, s3_client, storage_prefix
from fsdp_trainer.contract import METRICS_DIR, DataSpec, RankStacks, forensics_dir

# The FSDPTrainingRun API as every kubectl user sees it: its resource name (the operator's api.PLURAL and
# api.GROUP; tests/unit/test_crd.py holds them equal).
RESOURCE = "fsdptrainingruns.fsdp.training.dev"
KUBECTL_TIMEOUT_SECONDS = 30
# What the plugin prints is the tenant's text (logs, the trainer's records, status fields it fed). In a
# terminal, control characters (C0 but newline and tab, DEL, C1, whose \x9b is a CSI) act rather than read:
# they move the cursor, rewrite lines, set the title or the clipboard; bidirectional overrides make text read
# otherwise than it is. Each is printed escaped (\x1b); in describe's one-line fields newlines and tabs too.
_TERMINAL_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_LINE_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str) -> str:
    """Text as the terminal may be given it: lines stay lines (a carriage return ends one), every other
    control character is escaped."""
    return _TERMINAL_CONTROL.sub(_escaped, text.replace("\r\n", "\n").replace("\r", "\n"))


def one_line(value: Any) -> Any:
    """A value read from the run (strings at any depth) with every control character escaped, newlines and
    tabs too: a field of describe's output cannot start a line of its own."""
    if isinstance(value, str):
        return _LINE_CONTROL.sub(_escaped, value)
    if isinstance(value, dict):
        return {one_line(k): one_line(v) for k, v in value.items()}
    if isinstance(value, list):
        return [one_line(v) for v in value]
    return value


class PluginError(RuntimeError):
    """Said to the user on stderr, without a traceback."""


# -- reading the run and its storage ----------------------------------------------------------------------


def kubectl_args(options: argparse.Namespace) -> list[str]:
    """The kubectl options the user gave, passed on unchanged."""
    args = []
    for flag in ("namespace", "context", "kubeconfig"):
        value = getattr(options, flag, None)
        if value:
            args += [f"--{flag}", value]
    return args


def get_run(options: argparse.Namespace) -> dict[str, Any]:
    command = ["kubectl", "get", RESOURCE, options.run, "-o", "json", "--request-timeout=15s"]
    try:
        done = subprocess.run(
            command + kubectl_args(options), capture_output=True, text=True, timeout=KUBECTL_TIMEOUT_SECONDS
        )
    except FileNotFoundError as error:
        raise PluginError("kubectl is not on PATH") from error
    except subprocess.TimeoutExpired as error:
        raise PluginError(f"kubectl get took longer than {KUBECTL_TIMEOUT_SECONDS}s") from error
    if done.returncode != 0:
        said = done.stderr.strip().splitlines()
        raise PluginError(said[-1] if said else f"kubectl exited {done.returncode}")  # the last line says why
    run: dict[str, Any] = json.loads(done.stdout)
    return run


def logs(
    options: argparse.Namespace,
    run: dict[str, Any],
    objects: RunObjects,
    write: Callable[[str], None],
    refresh_run: Callable[[], dict[str, Any]],
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Prints the log; with --follow, what is added until the run has ended and its last lines are read."""
    for piece in run_logs.follow(
        objects,
        run,
        refresh_run,
        rank=options.rank,
        attempt=options.attempt,
        driver=options.driver,
        keep_following=options.follow,
        sleep=sleep,
    ):
        write(piece)


# -- describe ---------------------------------------------------------------------------------------------


def _number(value: Any, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def describe(run: dict[str, Any]) -> str:
    """The run at a glance: what ran, how far it got, where everything is."""
    run = one_line(run)
    meta, spec, status = run["metadata"], run["spec"], run.get("status") or {}
    image, record, progress = (
        status.get("image") or {},
        status.get("record") or {},
        status.get("progress") or {},
    )
    restarts, checkpoints = status.get("restarts") or {}, status.get("checkpoints") or {}
    transport = status.get("transport") or {}
    versions = ", ".join(f"{k} {v}" for k, v in (record.get("versions") or {}).items())
    rate = progress.get("tokensPerSecond")
    lines = [
        f"Name:          {meta['namespace']}/{meta['name']}",
        f"Phase:         {status.get('phase', '-')}  {status.get('message', '')}".rstrip(),
        f"Attempt:       {status.get('attempt', 0)}  (job {status.get('jobSubmissionId', '-')})",
        f"Started:       {status.get('startTime', '-')}   Completed: {status.get('completionTime', '-')}",
        f"Model:         {spec['model'].get('source') or 'fromConfig'}",
        f"Data:          {data_line(spec.get('data') or {}, progress.get('dataRows'))}",
        f"Adapter:       {adapter_line(spec.get('fsdp', {}).get('adapter'), progress.get('adapterBytes'))}",
        f"Image:         {image.get('requested', '-')}",
        f"  ran digest:  {image.get('digest', '-')}",
        f"Trainer:       sha256 {record.get('packageSha256', '-')}",
        f"Versions:      {versions or '-'}",
        f"Cluster:       {status.get('rayClusterName', '-')}  zone {status.get('zone', '-')}  "
        f"{spec.get('cluster', {}).get('workers', 1)} worker(s)",
        f"Transport:     {transport.get('observed', '-')}  bus bandwidth "
        f"{_number(transport.get('busBandwidthGbps'), '.2f')} GB/s",
        f"Fabric check:  {fabric_line(status.get('fabric') or {})}",
        f"Progress:      step {progress.get('step', '-')}/{progress.get('maxSteps', '-')}  "
        f"loss {_number(progress.get('loss'))}  eval loss {_number(progress.get('evalLoss'))}  "
        f"{_number(rate, ',.0f')} tok/s  MFU {_number(progress.get('mfu'), '.1%')}  "
        f"world size {progress.get('worldSize', '-')}",
        f"Checkpoints:   {len(checkpoints.get('recent') or [])} recent",
    ]
    lines += [f"  step {c['step']:>6}  {c['time']}  {c['uri']}" for c in checkpoints.get("recent") or []]
    lines += goodput_lines(status.get("goodput") or {})
    lines.append(f"Restarts:      {restarts.get('count', 0)}  preemptions {restarts.get('preemptions', 0)}")
    for entry in restarts.get("history") or []:
        resumed = entry.get("resumedFromStep")
        size = entry.get("worldSize")
        lines.append(
            f"  {entry['time']}  {entry['reason']}  resumed from step {'-' if resumed is None else resumed}"
            + (f"  (ran at world size {size})" if size else "")
            + f"  {entry.get('message', '')}".rstrip()
        )
    shown = ("Failed", "TransportDegraded", "FabricVerified")
    failing = [c for c in status.get("conditions") or [] if c["type"] in shown]
    lines += [
        f"Condition:     {c['type']}={c['status']} {c['reason']}: {c.get('message', '')}" for c in failing
    ]
    lines += [
        f"Exported model: {record.get('exportedModelUri', '-')}",
        f"Run record:    {record.get('uri', '-')}",
        f"Logs:          {record.get('logsUri') or storage_prefix(run) + '/logs'}",
    ]
    if spec.get("tracking", {}).get("mlflow"):
        lines.append(f"MLflow run:    {(record.get('mlflowRun') or {}).get('url', '- (not created yet)')}")
    return "\n".join(lines) + "\n"


def data_line(data: dict[str, Any], rows: dict[str, Any] | None) -> str:
    """The data format, the tokens the loss is on, and what became of the rows read so far."""
    spec = DataSpec.model_validate(data)
    packing = "packed" if spec.packing else "one example per sequence"
    line = f"{spec.source}  format {spec.format}, loss on {spec.learned_tokens()}, {packing}"
    if rows:
        line += (
            f"; {rows.get('read', 0)} rows read, {rows.get('unparsable', 0)} unparsable, "
            f"{rows.get('truncated', 0)} truncated, {rows.get('dropped', 0)} dropped"
        )
    return line


def adapter_line(adapter: dict[str, Any] | None, size: int | None) -> str:
    """The LoRA adapter's shape, and its size once the trainer has reported it."""
    if not adapter:
        return "none (every weight trains)"
    targets = ",".join(adapter.get("targetModules") or ["default projections"])
    merged = ", merged export too" if adapter.get("exportMerged") else ""
    sized = f", {size / 2**20:.1f} MiB" if size is not None else ""
    return f"LoRA rank {adapter.get('rank', 16)} alpha {adapter.get('alpha', 32)} on {targets}{merged}{sized}"


def fabric_line(fabric: dict[str, Any]) -> str:
    """The latest attempt's fabric check, and the nodes this run's checks marked slow."""
    if not fabric:
        return "-"
    report = fabric.get("report") or {}
    verdict = "passed" if report.get("passed", True) else "FAILED"
    avoided = ", ".join(node["node"] for node in fabric.get("avoidedNodes") or [])
    return (
        f"attempt {fabric.get('attempt', '-')} {verdict} in {_number(report.get('seconds'), '.1f')} s: "
        + str(report.get("message", ""))
        + (f"  (nodes labelled slow: {avoided})" if avoided else "")
    )


def goodput_lines(goodput: dict[str, Any]) -> list[str]:
    """Where the run's time went, what it held and cost."""
    seconds = goodput.get("seconds") or {}
    if not seconds:
        return []
    spent = "  ".join(f"{name} {_duration(value)}" for name, value in seconds.items() if value)
    cost = goodput.get("costUsd")
    per_million = goodput.get("costPerMillionTokensUsd")
    return [
        f"Goodput:       {_number(goodput.get('fraction'), '.1%')} of the time the cluster was held trained  "
        f"{_number(goodput.get('gpuHoursHeld'), '.2f')} GPU-h held"
        + (f"  ${cost:,.2f}" if cost is not None else "")
        + (f" (${per_million:,.4f} per million tokens)" if per_million is not None else ""),
        f"  time:        {spent or '-'}  (until {goodput.get('accountedUntil', '-')})",
        f"  progress:    {_number(goodput.get('progressPercent'), '.1f')} %  ETA {goodput.get('eta') or '-'}",
    ]


def _duration(seconds: int) -> str:
    minutes, second = divmod(int(seconds), 60)
    hours, minute = divmod(minutes, 60)
    return f"{hours}h{minute:02d}m{second:02d}s" if hours else f"{minute}m{second:02d}s"


# -- plot -------------------------------------------------------------------------------------------------


def plot_command(options: argparse.Namespace, objects: RunObjects, write: Callable[[str], None]) -> None:
    curves = plot.curves(metric_histories(objects))
    if not curves.loss:
        raise NotRecordedYet(f"no training metrics in {objects.bucket}/{objects.prefix}{METRICS_DIR}/ yet")
    if options.output:
        with open(options.output, "wb") as file:
            file.write(plot.png(curves))
        write(f"wrote {options.output}\n")
    else:
        write(plot.text(curves, width=options.width, height=options.height))


# -- diff -------------------------------------------------------------------------------------------------


def diff_command(options: argparse.Namespace, write: Callable[[str], None]) -> None:
    """Reads both runs through kubectl (the other in --other-namespace, if given), their records from S3."""
    other = argparse.Namespace(**vars(options))
    other.run = options.other_run
    if options.other_namespace:
        other.namespace = options.other_namespace
    s3 = s3_client()
    compared = rundiff.compare(
        RunObjects(s3, storage_prefix(get_run(options))),
        RunObjects(s3, storage_prefix(get_run(other))),
        everything=options.all,
    )
    write(str(compared))


# -- forensics --------------------------------------------------------------------------------------------


def forensics_command(
    options: argparse.Namespace, run: dict[str, Any], objects: RunObjects, write: Callable[[str], None]
) -> None:
    """Every rank's answer to the attempt's hang forensics: where its training thread was, its last step,
    every thread's stack and its last log lines; the suspect the operator named first."""
    found = (run.get("status") or {}).get("forensics") or {}
    attempt = options.attempt or found.get("attempt")
    if attempt is None:
        raise PluginError("the run has no hang forensics (none of its attempts was declared hung)")
    names = [n for n in objects.names(forensics_dir(attempt)) if n.rpartition("/")[2].startswith("rank-")]
    if not names:
        raise PluginError(
            f"no rank answered in s3://{objects.bucket}/{objects.prefix}{forensics_dir(attempt)}/"
        )
    suspect = found.get("suspect") if found.get("attempt") == attempt else None
    if suspect:
        write(
            f"suspect: rank {suspect['rank']} ({suspect.get('pod', '-')}, node {suspect.get('node', '-')}): "
            f"{suspect.get('why', '')}\n"
        )
    answers = sorted(
        (RankStacks.model_validate_json(objects.text(name) or "{}") for name in names), key=lambda a: a.rank
    )
    for answer in answers:
        where = "in a collective" if answer.in_collective else "not in a collective"
        write(
            f"\n=== rank {answer.rank}/{answer.world_size}  pod {answer.pod}  node {answer.node or '-'}  "
            f"step {answer.step}  training thread {where}: {answer.training_thread_top}\n"
        )
        for thread in answer.threads:
            write(f"--- thread {thread.name}{' (daemon)' if thread.daemon else ''}\n{thread.stack}")
        if answer.collectives:
            entered = "\n".join(f"  {c.process_group} #{c.seq} {c.op}" for c in answer.collectives)
            write(f"--- last collectives entered (torch's flight recorder)\n{entered}\n")
        detector = answer.nccl_hang_detector
        if detector is not None:
            confirmed = f", a hang confirmed ({detector.uri})" if detector.confirmed else ""
            write(f"--- Ray Train's NCCL hang detector: {detector.state}{confirmed}\n")
            for text in (detector.finding, detector.report):
                if text:
                    write(text if text.endswith("\n") else f"{text}\n")
        write(f"--- last log lines\n{answer.recent_log}")


# -- command line -----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: given before the command or after it, an option is kept (a subparser's default would undo it).
    common.add_argument("-n", "--namespace", default=argparse.SUPPRESS, help="the run's namespace")
    common.add_argument("--context", default=argparse.SUPPRESS, help="the kubeconfig context to use")
    common.add_argument("--kubeconfig", default=argparse.SUPPRESS, help="path to the kubeconfig file")
    parser = argparse.ArgumentParser(
        prog="kubectl trainingrun",
        description="Logs, summary and loss curves of an FSDPTrainingRun, read from its S3 prefix with your "
        "own AWS credentials.",
        parents=[common],
    )
    commands = parser.add_subparsers(dest="command", required=True)
    logs_parser = commands.add_parser("logs", parents=[common], help="a rank's log (or the driver's) from S3")
    logs_parser.add_argument("run")
    logs_parser.add_argument(
        "-f", "--follow", action="store_true", help="keep printing while the run is active"
    )
    logs_parser.add_argument("--rank", type=int, default=0, help="the worker rank (default 0)")
    logs_parser.add_argument("--attempt", type=int, default=None, help="the attempt (default: the latest)")
    logs_parser.add_argument("--driver", action="store_true", help="the Ray job's driver log instead")
    describe_parser = commands.add_parser("describe", parents=[common], help="the run at a glance")
    describe_parser.add_argument("run")
    plot_parser = commands.add_parser("plot", parents=[common], help="loss and eval-loss curves")
    plot_parser.add_argument("run")
    plot_parser.add_argument(
        "-o", "--output", help="write a PNG to this file instead of drawing in the terminal"
    )
    plot_parser.add_argument("--width", type=int, default=plot.TEXT_WIDTH, help="terminal plot columns")
    plot_parser.add_argument("--height", type=int, default=plot.TEXT_HEIGHT, help="terminal plot rows")
    diff_parser = commands.add_parser(
        "diff", parents=[common], help="what differs between two runs: what ran, config, transport, results"
    )
    diff_parser.add_argument("run")
    diff_parser.add_argument("other_run", metavar="other-run")
    diff_parser.add_argument("--other-namespace", help="the other run's namespace (default: the first's)")
    diff_parser.add_argument("--all", action="store_true", help="every field, not only those that differ")
    forensics_parser = commands.add_parser(
        "forensics", parents=[common], help="what every rank was doing when an attempt was declared hung"
    )
    forensics_parser.add_argument("run")
    forensics_parser.add_argument(
        "--attempt", type=int, default=None, help="the attempt (default: the latest one declared hung)"
    )
    return parser


def to_terminal(text: str) -> None:
    sys.stdout.write(printable(text))
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    options = build_parser().parse_args(argv)
    try:
        if options.command == "diff":
            diff_command(options, to_terminal)
            return 0
        run = get_run(options)
        if options.command == "describe":
            to_terminal(describe(run))
            return 0
        objects = RunObjects(s3_client(), storage_prefix(run))
        if options.command == "logs":
            logs(options, run, objects, to_terminal, lambda: get_run(options))
        elif options.command == "forensics":
            forensics_command(options, run, objects, to_terminal)
        else:
            plot_command(options, objects, to_terminal)
    except (PluginError, ClientError) as error:
        print(f"error: {printable(str(error))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
