"""Every process's CPU while a command runs, short-lived ones included: the kernel's BSD process accounting
(acct(2)) writes a record for each process that exits, with its command name, CPU and lifetime. A sampler of
/proc misses processes that live between two samples and the last seconds of every process; this does not.

    python bench/process_cpu.py -- make test        # accounting on, the command, accounting off, the report
    python bench/process_cpu.py --report FILE       # the report of a record file kept before (--keep FILE)

Needs CAP_SYS_PACCT (root here), and a machine where nothing else uses process accounting: the kernel keeps
one accounting file, so this takes it over and switches accounting off when the command ends, whatever its
exit (the host as found: off). CPU is in the kernel's 10 ms
ticks, each process's rounded down: a process of a few milliseconds counts 0, so short processes' sum is a
floor. Processes still running when the command ends are not in the report.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# struct acct_v3 (include/uapi/linux/acct.h): flag, version, tty, exitcode, uid, gid, pid, ppid, btime,
# etime (float, ticks), utime, stime, mem, io, rw, minflt, majflt, swaps (comp_t), comm[16].
RECORD = struct.Struct("<BBHIIIIIIf8H16s")
ACCT_V3 = 3
AHZ = 100  # the ticks of acct_v3's times
SHORT_SECONDS = 5.0


@dataclass(frozen=True)
class Exited:
    command: str
    cpu_seconds: float
    lived_seconds: float


def comp_t(value: int) -> int:
    """comp_t: a 13-bit mantissa and a 3-bit base-8 exponent."""
    return (value & 0x1FFF) << (3 * (value >> 13))


def read_records(path: Path) -> list[Exited]:
    data = path.read_bytes()
    exited = []
    for offset in range(0, len(data) - RECORD.size + 1, RECORD.size):
        fields = RECORD.unpack_from(data, offset)
        if fields[1] & 0x0F != ACCT_V3:
            raise ValueError(f"{path}: record at {offset} is version {fields[1] & 0x0F}, not {ACCT_V3}")
        cpu = (comp_t(fields[10]) + comp_t(fields[11])) / AHZ
        command = fields[18].split(b"\0", 1)[0].decode(errors="replace")
        exited.append(Exited(command, cpu, fields[9] / AHZ))
    return exited


def switch_accounting(path: Path | None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.acct(str(path).encode() if path else None) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"acct({path}): {os.strerror(error)}")


def report(exited: list[Exited], top: int) -> str:
    every, every_count = collections.Counter[str](), collections.Counter[str]()
    short, short_count = collections.Counter[str](), collections.Counter[str]()
    for process in exited:
        every[process.command] += process.cpu_seconds
        every_count[process.command] += 1
        if process.lived_seconds < SHORT_SECONDS:
            short[process.command] += process.cpu_seconds
            short_count[process.command] += 1
    lines = [
        f"{len(exited)} processes exited, {sum(every.values()):.0f} CPU-s; of them lived under "
        f"{SHORT_SECONDS:.0f} s: {sum(short_count.values())} processes, {sum(short.values()):.0f} CPU-s",
        f"{'command':16s} {'CPU-s':>9s} {'processes':>9s}   {'short CPU-s':>11s} {'short ones':>10s}",
    ]
    for command, cpu in every.most_common(top):
        lines.append(
            f"{command:16s} {cpu:9.1f} {every_count[command]:9d}   {short[command]:11.1f} "
            f"{short_count[command]:10d}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--report", type=Path, help="report a record file instead of running a command")
    parser.add_argument("--keep", type=Path, help="keep the records here (default: a temporary file)")
    parser.add_argument("--top", type=int, default=30, help="commands in the report, by CPU")
    parser.add_argument("command", nargs="*", help="the command to run under accounting (after --)")
    args = parser.parse_args()
    if args.report:
        print(report(read_records(args.report), args.top))
        return 0
    if not args.command:
        parser.error("a command to run, or --report FILE")
    records = args.keep or Path(tempfile.mkstemp(prefix="process-cpu-", suffix=".acct")[1])
    records.touch()
    switch_accounting(records)
    try:
        exit_code = subprocess.call(args.command)
    finally:
        switch_accounting(None)
    print(report(read_records(records), args.top), file=sys.stderr)
    if not args.keep:
        records.unlink()
    return exit_code


if __name__ == "__main__":
    raise SystemExit(main())
