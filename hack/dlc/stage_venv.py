"""Stages the host's DLC venv for the DLC stand-in image: the files of every distribution the DLC's lock
pins (and pip), hard-linked into DEST as the image's /opt/venv, so that the image gets what pip already
unpacked and byte-compiled here instead of installing the same wheels a second time.

Run with the DLC venv's interpreter: python stage_venv.py LOCK DEST. Left out: the venv's test tools (not in
the lock), Triton (it compiles CUDA kernels only) and the CUDA libraries torch does not link (a GPU dlopens
them; what torch links stays, so that `import torch` works). Console scripts get the image's interpreter in
their first line. The byte code stays valid (see whole_seconds), and Python corrects the file names a .pyc
carries when it loads one from another place.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import distributions
from pathlib import Path

IMAGE_VENV = "/opt/venv"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(lock: Path) -> dict[str, str]:
    found = {}
    for line in lock.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^]]*\])?==([^\s;#]+)", line)
        if match:
            found[canonical(match[1])] = match[2]
    return found


def linked_cuda_libraries(site: Path) -> set[Path]:
    """The files under nvidia/ that torch's own libraries load at start (ldd resolves their RPATHs here)."""
    torch_libraries = [*site.glob("torch/lib/*.so*"), *site.glob("torch/_C*.so")]
    output = subprocess.run(["ldd", *map(str, torch_libraries)], capture_output=True, text=True).stdout
    return {Path(p).resolve() for p in re.findall(r"=> (\S*/nvidia/\S+)", output)}


def whole_seconds(path: Path) -> None:
    """The file's mtime without its fraction of a second. A .pyc records its source's mtime in whole
    seconds, and podman's COPY rounds mtimes to the nearest second, which made about half of the sources newer
    than their byte code in the image (1,060 modules compiled again by the imports of a Ray Train worker).
    Cutting the fraction keeps every .pyc valid, here (a hard link shares the host venv's file) and in the
    image."""
    stat = path.stat()
    if stat.st_mtime_ns % 1_000_000_000:
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns - stat.st_mtime_ns % 1_000_000_000))


def stage(lock: Path, dest: Path) -> None:
    venv = Path(sys.prefix)
    site = next(Path(p) for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    wanted = pins(lock)
    kept, mismatched = [], []
    for dist in distributions():
        name = canonical(dist.metadata["Name"])
        if name == "pip" or name in wanted:
            kept.append(dist)
            if name in wanted and dist.version != wanted[name]:
                mismatched.append(f"{name} {dist.version} (the lock pins {wanted[name]})")
    missing = set(wanted) - {canonical(d.metadata["Name"]) for d in kept}
    if mismatched or missing:
        sys.exit(f"{venv} does not match {lock}: {mismatched or sorted(missing)}; run `make venv-dlc`")
    cuda = linked_cuda_libraries(site)
    shebang = f"#!{venv}/bin/python".encode()
    for dist in kept:
        for record in dist.files or []:
            source = Path(os.path.normpath(str(dist.locate_file(record))))
            relative = source.relative_to(venv)
            parts = relative.parts
            if not source.is_file() or (parts[0] == "bin" and parts[1].startswith("python")):
                continue
            inside = source.relative_to(site).parts if source.is_relative_to(site) else ()
            if inside[:1] == ("triton",):
                continue
            if inside[:1] == ("nvidia",) and ".so" in source.name and source.resolve() not in cuda:
                continue
            target = dest / relative
            if target.exists():  # a namespace package's file, in the RECORD of each of its distributions
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            if parts[0] == "bin" and (script := source.read_bytes()).startswith(shebang):
                target.write_bytes(f"#!{IMAGE_VENV}/bin/python".encode() + script[script.index(b"\n") :])
                target.chmod(0o755)
                continue
            try:
                os.link(source, target)
            except OSError:  # another file system: a copy, with the source's mtime
                shutil.copy2(source, target)
            whole_seconds(target)


if __name__ == "__main__":
    stage(Path(sys.argv[1]), Path(sys.argv[2]))
