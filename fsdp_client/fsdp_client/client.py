"""FSDPTrainingRuns from Python: create, read, wait, follow logs, read metrics, compare.

The spec is validated here with the pydantic models the CRD is generated from (fsdp_operator.api), so a
mistake names its field before anything reaches the cluster. What a run leaves in S3 is read with this
environment's AWS identity, through the same readers as `kubectl trainingrun`.
"""

from __future__ import annotations

import builtins
import re
import time
from collections.abc import Collection, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from fsdp_client import logs, metrics, plot, rundiff
from fsdp_client.errors import ClientError, InvalidSpec, RunFailed, WaitTimedOut
from fsdp_client.kube import REQUEST_TIMEOUT_SECONDS, Cluster
from fsdp_client.runs import TrainingRun
from fsdp_client.storage import RunObjects, metric_histories, run_record, s3_client, storage_prefix
from fsdp_operator import api
from fsdp_trainer.contract import ProgressRecord, RunRecord

if TYPE_CHECKING:
    import pandas

WAIT_POLL_SECONDS = 2.0
RunRef = str | TrainingRun


def _loc(location: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in location)


def validate_name(name: str) -> None:
    """A run's name is copied into labels: a label value's rules, not only an object name's."""
    if len(name) > 63 or not re.match(api.LABEL_VALUE_NAME, name):
        raise InvalidSpec(
            f"invalid metadata.name {name!r}: at most 63 lower-case letters, digits, '-' and '.', "
            "starting and ending with a letter or digit"
        )


def validated_spec(
    spec: api.FSDPTrainingRunSpec | Mapping[str, Any] | None, fields: Mapping[str, Any]
) -> dict[str, Any]:
    """The spec as the apiserver is sent it: what was given (camelCase or snake_case keys; `fields` over
    `spec`), validated by the CRD's own models. Defaults are left to the cluster, as `kubectl apply` does."""
    if isinstance(spec, api.FSDPTrainingRunSpec):
        spec = spec.model_dump(mode="json", by_alias=True, exclude_unset=True)
    try:
        model = api.FSDPTrainingRunSpec.model_validate({**(spec or {}), **fields})
    except ValidationError as error:
        said = "; ".join(f"spec.{_loc(e['loc'])}: {e['msg']}" for e in error.errors())
        raise InvalidSpec(f"invalid spec: {said}") from None
    dumped: dict[str, Any] = model.model_dump(mode="json", by_alias=True, exclude_unset=True)
    return dumped


class Client:
    """Runs in one cluster, by default in one namespace (the kubeconfig context's, or the pod's).

    client = Client()                       # KUBECONFIG's current context, its namespace
    run = client.create("qwen-ft", model={"source": "Qwen/Qwen2.5-1.5B"},
                        checkpoint={"storagePath": "s3://bucket/runs"}, training={"maxSteps": 1000})
    run = client.wait("qwen-ft", timeout=24 * 3600)      # Succeeded, or raises RunFailed with its reason
    client.metrics("qwen-ft")                             # a pandas DataFrame, one row per logged step
    """

    def __init__(
        self,
        namespace: str | None = None,
        *,
        context: str | None = None,
        kubeconfig: str | None = None,
        s3: Any = None,
    ) -> None:
        self.cluster = Cluster(namespace, context, kubeconfig)
        self._s3 = s3

    @property
    def namespace(self) -> str:
        return self.cluster.namespace

    # -- the runs -----------------------------------------------------------------------------------------

    def create(
        self,
        name: str,
        spec: api.FSDPTrainingRunSpec | Mapping[str, Any] | None = None,
        *,
        namespace: str | None = None,
        labels: Mapping[str, str] | None = None,
        **fields: Any,
    ) -> TrainingRun:
        """A new run from a spec (the model, or a mapping as in the manifest) and/or the spec's fields as
        keyword arguments (`model=`, `training=`, ...; those override the spec's)."""
        validate_name(name)
        namespace = namespace or self.namespace
        body = {
            "apiVersion": api.API_VERSION,
            "kind": api.KIND,
            "metadata": {
                "name": name,
                "namespace": namespace,
                **({"labels": dict(labels)} if labels else {}),
            },
            "spec": validated_spec(spec, fields),
        }
        created = self.cluster.call(
            "create",
            namespace,
            name,
            lambda custom: custom.create_namespaced_custom_object(
                api.GROUP, api.VERSION, namespace, api.PLURAL, body, _request_timeout=REQUEST_TIMEOUT_SECONDS
            ),
        )
        return TrainingRun(created)

    def get(self, run: RunRef, namespace: str | None = None) -> TrainingRun:
        name, namespace = self._name(run, namespace)
        found = self.cluster.call(
            "get",
            namespace,
            name,
            lambda custom: custom.get_namespaced_custom_object(
                api.GROUP, api.VERSION, namespace, api.PLURAL, name, _request_timeout=REQUEST_TIMEOUT_SECONDS
            ),
        )
        return TrainingRun(found)

    def list(self, namespace: str | None = None, label_selector: str | None = None) -> list[TrainingRun]:
        namespace = namespace or self.namespace
        found = self.cluster.call(
            "list",
            namespace,
            None,
            lambda custom: custom.list_namespaced_custom_object(
                api.GROUP,
                api.VERSION,
                namespace,
                api.PLURAL,
                label_selector=label_selector or "",
                _request_timeout=REQUEST_TIMEOUT_SECONDS,
            ),
        )
        return [TrainingRun(item) for item in found["items"]]

    def delete(self, run: RunRef, namespace: str | None = None) -> None:
        """Deletes the run (its RayCluster goes with it); what it left in S3 stays."""
        name, namespace = self._name(run, namespace)
        self.cluster.call(
            "delete",
            namespace,
            name,
            lambda custom: custom.delete_namespaced_custom_object(
                api.GROUP, api.VERSION, namespace, api.PLURAL, name, _request_timeout=REQUEST_TIMEOUT_SECONDS
            ),
        )

    def suspend(self, run: RunRef, namespace: str | None = None) -> TrainingRun:
        """Tears the run's cluster down, keeping its checkpoints; `resume` goes on from the latest."""
        return self._set_suspend(run, namespace, True)

    def resume(self, run: RunRef, namespace: str | None = None) -> TrainingRun:
        return self._set_suspend(run, namespace, False)

    def _set_suspend(self, run: RunRef, namespace: str | None, suspend: bool) -> TrainingRun:
        name, namespace = self._name(run, namespace)
        patched = self.cluster.call(
            "patch",
            namespace,
            name,
            lambda custom: custom.patch_namespaced_custom_object(
                api.GROUP,
                api.VERSION,
                namespace,
                api.PLURAL,
                name,
                {"spec": {"suspend": suspend}},
                _request_timeout=REQUEST_TIMEOUT_SECONDS,
            ),
        )
        return TrainingRun(patched)

    def wait(
        self,
        run: RunRef,
        *,
        phase: str | Collection[str] | None = None,
        condition: str | None = None,
        timeout: float = 3600,
        namespace: str | None = None,
    ) -> TrainingRun:
        """Waits until the run is in `phase` (one or several) or its `condition` is True (default: until it
        has finished, condition Finished) and returns it. A run that fails first raises RunFailed with the
        status's reason and message; one still short of it after `timeout` seconds, WaitTimedOut."""
        name, namespace = self._name(run, namespace)
        phases = {phase} if isinstance(phase, str) else set(phase or ())
        condition = condition or (None if phases else "Finished")
        wanted = " or ".join([*sorted(phases), *([f"condition {condition}"] if condition else [])])
        deadline = time.monotonic() + timeout
        while True:
            current = self.get(name, namespace)
            reached = current.phase in phases or (
                condition is not None
                and (found := current.condition(condition)) is not None
                and found.status == "True"
            )
            if current.phase == api.Phase.FAILED and api.Phase.FAILED not in phases and condition != "Failed":
                failed = current.condition("Failed")
                reason = failed.reason if failed else "Failed"
                raise RunFailed(
                    current, reason, (failed.message if failed else None) or current.status.message or ""
                )
            if reached:
                return current
            if current.phase == api.Phase.SUCCEEDED:
                raise ClientError(f"run {namespace}/{name} succeeded without reaching {wanted}")
            if time.monotonic() >= deadline:
                unseen = current.status.phase is None
                raise WaitTimedOut(
                    f"run {namespace}/{name} did not reach {wanted} in {timeout:.0f} s: "
                    + (
                        f"the operator has not written its status: is namespace {namespace} one it watches "
                        "(the chart's watchNamespaces)?"
                        if unseen
                        else f"it is {current.phase}: {current.status.message or ''}".rstrip(": ")
                    )
                )
            time.sleep(WAIT_POLL_SECONDS)

    # -- what the run leaves in S3 --------------------------------------------------------------------------

    def logs(
        self,
        run: RunRef,
        *,
        rank: int = 0,
        attempt: int | None = None,
        driver: bool = False,
        follow: bool = False,
        namespace: str | None = None,
    ) -> Iterator[str]:
        """A rank's log (or the Ray driver's) of the latest attempt (or of `attempt`), as pieces of text.
        With `follow`, what the trainer adds until the run ends, moving on to each new attempt's log."""
        current = self.get(run, namespace)
        yield from logs.follow(
            self._objects(current),
            current.obj,
            lambda: self.get(current.name, current.namespace).obj,
            rank=rank,
            attempt=attempt,
            driver=driver,
            keep_following=follow,
        )

    def log(
        self, run: RunRef, *, rank: int = 0, attempt: int | None = None, namespace: str | None = None
    ) -> str:
        """A rank's log as stored now, whole."""
        return "".join(self.logs(run, rank=rank, attempt=attempt, namespace=namespace))

    def histories(
        self, run: RunRef, namespace: str | None = None
    ) -> builtins.list[builtins.list[ProgressRecord]]:
        """The trainer's record of every logged step, one list per attempt, as it wrote them."""
        return metric_histories(self._objects(self.get(run, namespace)))

    def metrics(self, run: RunRef, namespace: str | None = None) -> pandas.DataFrame:
        """One row per logged step of each attempt: attempt, step, loss, eval_loss, tokens_per_second,
        mfu, world_size, updated_at."""
        return metrics.dataframe(metrics.rows(self.histories(run, namespace)))

    def loss_curve(self, run: RunRef, namespace: str | None = None) -> plot.LossCurve:
        """The loss and eval-loss curves of every attempt, restarts marked: a PNG in Jupyter."""
        return plot.LossCurve(plot.curves(self.histories(run, namespace)))

    def record(self, run: RunRef, namespace: str | None = None) -> RunRecord:
        """run.json: what ran (image digest, versions, the resolved config), every checkpoint and restart."""
        return run_record(self._objects(self.get(run, namespace)))

    def diff(
        self,
        a: RunRef,
        b: RunRef,
        *,
        namespace: str | None = None,
        other_namespace: str | None = None,
        everything: bool = False,
    ) -> rundiff.RunDiff:
        """What differs between two runs' records and histories (every field with `everything`)."""
        return rundiff.compare(
            self._objects(self.get(a, namespace)),
            self._objects(self.get(b, other_namespace or namespace)),
            everything=everything,
        )

    # -------------------------------------------------------------------------------------------------------

    def _name(self, run: RunRef, namespace: str | None) -> tuple[str, str]:
        if isinstance(run, TrainingRun):
            return run.name, namespace or run.namespace
        return run, namespace or self.namespace

    def _objects(self, run: TrainingRun) -> RunObjects:
        if self._s3 is None:
            self._s3 = s3_client()
        return RunObjects(self._s3, storage_prefix(run.obj))
