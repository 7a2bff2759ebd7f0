"""The trainer package's two ways to a Ray head, measured side by side on the local cluster's real head:

- dashboard: the operator's job client zips `fsdp_trainer` and uploads it through the dashboard
  (`GET`/`PUT /api/packages/gcs/_ray_pkg_<hash>.zip`, once per head), `py_modules: [gcs://...]`;
- s3: the same zip stored once per sha256 in S3 beside the runs (`<bucket>/packages/<sha256>.zip`, the module
  one level down: Ray strips a remote zip's top directory), `py_modules: [s3://...]`, fetched by the head's
  runtime-env agent with boto3 and smart_open.

Each round submits `python -c "import fsdp_trainer.contract"` once each way, alternating, under a fresh
package name (a fresh hash: nothing cached on the head), and times submit (the operator's side) and submit to
SUCCEEDED (the head fetching and unpacking the package, then the driver).

    python bench/package_upload.py [--rounds 5]      (needs make cluster-up)

Prints JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import statistics
import time
import uuid
import zipfile
from pathlib import Path
from typing import Any

import boto3
from tests.support.local_cluster import LocalCluster
from tests.support.waiting import wait_until

from fsdp_operator import jobclient, submission
from fsdp_operator.jobs import DashboardAuth, Jobs

REPO = Path(__file__).resolve().parents[1]

BUCKET = "fsdp-package-bench"


def fresh_package(tmp: Path, tag: str) -> Path:
    """A copy of the trainer package with one file more, so that its hash (and name) is new."""
    target = tmp / tag / "fsdp_trainer"
    for path in jobclient.package_files(submission.TRAINER_PACKAGE):
        dest = target / path.relative_to(submission.TRAINER_PACKAGE)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(path.read_bytes())
    (target / "_bench_tag.txt").write_text(tag)
    return target


def s3_zip(package: Path) -> bytes:
    """The package zipped one level down (`pkg/fsdp_trainer/...`): Ray unpacks a remote zip without its top
    directory, which leaves `fsdp_trainer/` where py_modules expects it."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for path in jobclient.package_files(package):
            name = (Path("pkg") / package.name / path.relative_to(package)).as_posix()
            info = zipfile.ZipInfo(name, jobclient.ZIP_DATE)
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, path.read_bytes())
    return buffer.getvalue()


def run_job(jobs: Jobs, submission_id: str, py_module: str) -> tuple[float, float]:
    start = time.monotonic()
    jobs.submit(submission_id, 'python -c "import fsdp_trainer.contract"', {"py_modules": [py_module]}, {})
    submitted = time.monotonic() - start

    def done() -> bool:
        status = jobs.observe(submission_id, with_logs=False).status
        assert status not in ("FAILED", "STOPPED"), jobs.logs_tail(submission_id)
        return status == "SUCCEEDED"

    wait_until(f"{submission_id} succeeded", done, timeout=300, interval=0.1)
    return submitted, time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cluster = LocalCluster.from_env_file()
    os.environ.update(cluster.env)
    s3 = boto3.client("s3", endpoint_url=cluster.s3_endpoint)
    if BUCKET not in [b["Name"] for b in s3.list_buckets()["Buckets"]]:
        s3.create_bucket(Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
    jobs = Jobs(cluster.ray_dashboard_url, DashboardAuth(headers=tuple(cluster.ray_token_header.items())))
    tmp = Path(cluster.env["FSDP_LOCAL_CLUSTER_STATE"]) / "package-bench"
    figures: dict[str, dict[str, list[float]]] = {
        way: {"operator_side_s": [], "submit_to_succeeded_s": []} for way in ("dashboard", "s3")
    }
    sizes: dict[str, int] = {}
    for round_ in range(args.rounds):
        for way in ("dashboard", "s3") if round_ % 2 == 0 else ("s3", "dashboard"):
            tag = uuid.uuid4().hex[:8]
            package = fresh_package(tmp, tag)
            start = time.monotonic()
            if way == "dashboard":
                module = str(package)
                sizes[way] = len(jobclient.zip_package(package)[1])
                upload = 0.0
            else:
                data = s3_zip(package)
                key = f"packages/{hashlib.sha256(data).hexdigest()}.zip"
                s3.put_object(Bucket=BUCKET, Key=key, Body=data)  # once per sha256 in the operator
                module, upload, sizes[way] = f"s3://{BUCKET}/{key}", time.monotonic() - start, len(data)
            submitted, succeeded = run_job(jobs, f"package-{way}-{tag}", module)
            figures[way]["operator_side_s"].append(round(upload + submitted, 3))
            figures[way]["submit_to_succeeded_s"].append(round(succeeded, 3))
    medians: dict[str, Any] = {
        way: {name: round(statistics.median(values), 3) for name, values in figure.items()}
        for way, figure in figures.items()
    }
    print(
        json.dumps(
            {
                "rounds": args.rounds,
                "zip_bytes": sizes,
                "figures": figures,
                "medians": medians,
                "ratio_s3_over_dashboard_submit_to_succeeded": round(
                    medians["s3"]["submit_to_succeeded_s"] / medians["dashboard"]["submit_to_succeeded_s"], 2
                ),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
