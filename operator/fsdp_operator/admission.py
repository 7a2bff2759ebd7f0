"""GPU admission: which waiting run may create its RayCluster now, decided for all the runs at once.

`Admission.admit` is the one entry point. It owns the queue's placement (preflight.Queue, placed again only
when the view changes), its memory (runs it admitted that the index does not show yet, parsed specs, free
nodes per placement) and its lock: one decision at a time, so two runs never split the same nodes. A
placement decides every waiting run of the queue at once: the runs it admits are admitted then, and each
finds its decision at its own pass instead of placing the queue again. The decisions themselves are
preflight's pure functions. Before its first decision on a run it also warns, once,
when the run's pods would have no AWS credentials (credentials.py): before any GPU is held.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any, cast

import kopf
from pydantic import ValidationError

from fsdp_operator import api, builder, conditions, credentials, metrics, preflight
from fsdp_operator.kube import Indexes, Kube
from fsdp_operator.launchers import LauncherReader

log = logging.getLogger("fsdp_operator")

# A namespaced operator cannot watch other teams' pods: all pending runs' preflights share one LIST this long.
PODS_SNAPSHOT_SECONDS = 10.0
# A run this process admitted reserves its slots until the view shows it admitted (its status write came back)
# or done with them (finished, suspended); at most this long.
ADMISSION_MEMORY_SECONDS = 120.0
# A run admitted by another run's placement takes that decision at its own pass within this long; later, the
# view it was made on may have gone (a node drained), and the run is placed again. At 1,000 runs a placement
# costs half a CPU-second, and every worker pod bound changes the view: placed once per run, the queue was
# placed 1,052 times to start 1,000 runs, one after another under the lock.
DECIDED_FOR_SECONDS = 60.0
# EC2's answer about an instance type (GPUs, EFA, zones) changes with AWS's catalogue, not per run: asked once
# per type this often, not twice per waiting scale-from-zero run per recheck (EC2 throttles per account).
EC2_FACTS_SECONDS = 600.0


@dataclasses.dataclass
class Admitted:
    """A run this process admitted, remembered until the index shows it admitted."""

    since: float  # time.monotonic() of the decision
    holds: preflight.Competitor  # the slots it reserves
    # Admitted by another run's placement, its own pass still to come: the spec it was decided for and the
    # result that pass takes.
    decided: tuple[api.FSDPTrainingRunSpec, preflight.PreflightResult] | None = None


class Admission:
    def __init__(
        self,
        watch_namespaces: list[str],
        kube: Kube | None,
        ec2: Callable[[], Any],
        efa_through_dra: bool = False,
        max_active_per_namespace: int = 0,
        autoscaling: Callable[[], Any] = lambda: None,
        platform: builder.Platform | None = None,
        ray_pod_env: Mapping[str, str] | None = None,
    ) -> None:
        self.watch_namespaces = watch_namespaces
        self.ray_pod_env = dict(ray_pod_env or {})  # what every Ray container gets: static keys, if any
        self.max_active_per_namespace = max_active_per_namespace  # 0: no limit
        # Nodes that expose EFA through DRA advertise no vpc.amazonaws.com/efa: the scheduler allocates the
        # interfaces with the pod, and admission counts GPUs, CPU, memory and disk only.
        self.efa_through_dra = efa_through_dra
        self.kube = kube
        self.ec2 = ec2  # the EC2 client, built on first use
        self._ec2_facts: dict[str, tuple[float, preflight.InstanceTypeFacts]] = {}
        self.launchers = LauncherReader(kube, ec2, autoscaling)  # what can add nodes: where workers may go
        self.platform = platform or builder.Platform()  # where heads go (the operator's settings)
        self._lock = threading.Lock()
        self._admitted: dict[str, Admitted] = {}  # run uid ->
        self._pods_view: tuple[float, list[dict[str, Any]]] | None = None
        self._queues: dict[str, preflight.Queue] = {}  # instance type -> its last placement
        # (placement key, with the pods?) -> the nodes and pods it was built from, and the free nodes
        self._free_nodes: dict[
            tuple[str, bool], tuple[list[Any], list[Any], tuple[preflight.NodeFree, ...]]
        ] = {}
        self._placement_keys: dict[int, tuple[api.FSDPTrainingRunSpec, str]] = {}
        # run uid -> (generation, its spec as parsed then)
        self._specs: dict[str, tuple[int | None, api.FSDPTrainingRunSpec | None]] = {}
        self._credentials_checked: dict[
            str, str
        ] = {}  # run uid -> the service account its pods were checked as
        self.queue_placements = 0  # how many times a whole queue was placed
        self.cpu_seconds = 0.0  # thread CPU time spent deciding admissions

    def admit(
        self, run: builder.RunRef, spec: api.FSDPTrainingRunSpec, created: str, indexes: Indexes
    ) -> preflight.PreflightResult:
        """May `run` (created at `created`) create its RayCluster now, and in which zone?"""
        self._warn_of_missing_credentials(run, spec)
        with self._lock:
            limited = self._namespace_limit(run, indexes)
        if limited is not None:
            return limited
        with self._lock:
            nodes, pods = self._nodes_and_pods(indexes)
        head = preflight.head_fits_no_node(
            spec, self.platform, nodes, [p for p in pods if preflight.is_daemon(p)]
        )
        if head is not None:
            return head
        if spec.preflight.scale_from_zero:
            facts = self.instance_type_facts(spec.cluster.instance_type)
            result = preflight.check_instance_type(spec, facts, self.launchers.read())
            if result.ok:  # remembered for its namespace's limit until the index shows it active
                name = f"{run.namespace}/{run.name}"
                own = preflight.Competitor(name, created, spec.cluster.instance_type, True, None, 0)
                with self._lock:
                    self._admitted[run.uid] = Admitted(time.monotonic(), own)
            return result
        with self._lock:
            start = time.thread_time()
            try:
                return self._place(run, spec, created, indexes)
            finally:
                spent = time.thread_time() - start
                self.cpu_seconds += spent
                metrics.ADMISSION_CPU.inc(spent)

    def _warn_of_missing_credentials(self, run: builder.RunRef, spec: api.FSDPTrainingRunSpec) -> None:
        """A Warning event on the run, once per service account it names, when its pods would have no AWS
        credentials: a warning, not a refusal (keys may come from where the operator cannot see)."""
        account = credentials.service_account_of(spec)
        if self.kube is None or self._credentials_checked.get(run.uid) == account:
            return
        try:
            found = self.kube.service_account(run.namespace, account)
        except (
            Exception
        ) as error:  # no grant to read it, the apiserver's hiccup: no warning, the next pass asks
            log.info("%s/%s: service account %s unreadable: %s", run.namespace, run.name, account, error)
            return
        self._credentials_checked[run.uid] = account
        warning = credentials.missing_credentials(run.namespace, spec, found, self.ray_pod_env)
        if warning is None:
            return
        body = {
            "apiVersion": api.API_VERSION,
            "kind": api.KIND,
            "metadata": {"name": run.name, "namespace": run.namespace, "uid": run.uid},
        }
        reason = credentials.NO_POD_CREDENTIALS
        kopf.event(
            kopf.Body(cast(Any, body)), type="Warning", reason=reason, message=conditions.bounded(warning)
        )
        log.warning("%s/%s %s: %s", run.namespace, run.name, reason, warning)

    def instance_type_facts(self, instance_type: str) -> preflight.InstanceTypeFacts:
        now = time.monotonic()
        kept = self._ec2_facts.get(instance_type)
        if kept is None or now - kept[0] > EC2_FACTS_SECONDS:
            kept = self._ec2_facts[instance_type] = (
                now,
                preflight.ec2_instance_type_facts(self.ec2(), instance_type),
            )
        return kept[1]

    def _namespace_limit(self, run: builder.RunRef, indexes: Indexes) -> preflight.PreflightResult | None:
        """A run waits while its namespace has max_active_per_namespace runs with clusters (admitted here or
        shown active by the index): one team cannot take every node of a shared cluster."""
        if not self.max_active_per_namespace:
            return None
        active = self._active_in(run.namespace, indexes) - {run.uid}
        if len(active) < self.max_active_per_namespace:
            return None
        return preflight.PreflightResult(
            False,
            preflight.NAMESPACE_RUN_LIMIT,
            f"namespace {run.namespace} has {len(active)} active runs, the operator's limit per namespace "
            "(max-active-runs-per-namespace); this run starts when one of them ends",
        )

    def _active_in(self, namespace: str, indexes: Indexes) -> set[str]:
        """The uids of the namespace's runs with clusters: shown active by the index, or admitted here."""
        shown = indexes.active_runs.get(namespace) if indexes.active_runs is not None else None
        return set(shown or ()) | {
            uid
            for uid, admitted in self._admitted.items()
            if preflight.namespace_of(admitted.holds.name) == namespace
        }

    @staticmethod
    def active_run(body: Mapping[str, Any]) -> dict[str, str] | None:
        """The index entry of a run whose status shows it holding a cluster: its namespace's limit counts it
        (a lookup per admission, where a scan of every run would grow with all teams' runs)."""
        if (body.get("status") or {}).get("phase") not in api.ACTIVE_PHASES:
            return None
        return {body["metadata"]["namespace"]: body["metadata"]["uid"]}

    def forget(self, uid: str) -> None:
        with self._lock:
            self._admitted.pop(uid, None)
            self._specs.pop(uid, None)
            self._credentials_checked.pop(uid, None)

    def remembers(self, uid: str) -> bool:
        return uid in self._specs or uid in self._admitted

    def _place(
        self, run: builder.RunRef, spec: api.FSDPTrainingRunSpec, created: str, indexes: Indexes
    ) -> preflight.PreflightResult:
        mine = self._admitted.get(run.uid)
        if mine is not None and mine.decided is not None:
            decided_for, result = mine.decided
            if time.monotonic() - mine.since <= DECIDED_FOR_SECONDS and decided_for == spec:
                self._admitted[run.uid] = Admitted(time.monotonic(), mine.holds)  # until the index shows it
                return result
            del self._admitted[run.uid]  # decided on a view that may be gone, or for another spec
        nodes, pods = self._nodes_and_pods(indexes)
        by_uid = self._competitors(run, indexes, nodes, pods)
        competitors = list(by_uid.values())
        name = f"{run.namespace}/{run.name}"
        if not any(c.name == name and not c.admitted for c in competitors):  # not in the index (yet)
            free = self._free(preflight.placement_key(spec), spec, nodes, pods)
            own = preflight.Competitor(
                name, created, spec.cluster.instance_type, False, None, spec.cluster.workers
            )
            competitors.append(dataclasses.replace(own, spec=spec, free=free))
        # One placement of the queue serves every run's pass until the view changes (preflight.Queue).
        instance_type = spec.cluster.instance_type
        queue = self._queues.get(instance_type)
        queue = queue.still_holds(competitors) if queue is not None else None
        if queue is None or name not in queue.results:
            queue = preflight.Queue.place(competitors, instance_type)
            self.queue_placements += 1
            metrics.QUEUE_PLACEMENTS.inc()
        self._queues[instance_type] = queue
        result = queue.results[name]
        if result.ok:
            self._admitted[run.uid] = Admitted(time.monotonic(), _holding(name, created, spec, result))
        self._admit_the_others(queue, run.uid, by_uid, indexes)
        if not result.ok:
            empty = self._free(preflight.placement_key(spec), spec, nodes, pods, empty=True)
            return preflight.worker_fits_no_node(spec, list(empty)) or result
        return result

    def _admit_the_others(
        self, queue: preflight.Queue, uid: str, by_uid: Mapping[str, preflight.Competitor], indexes: Indexes
    ) -> None:
        """Every other waiting run the placement admits is admitted now, in the queue's order, as far as its
        namespace's limit allows: its slots are reserved from this moment, and its own pass takes the
        decision."""
        now = time.monotonic()
        uid_of = {competitor.name: other for other, competitor in by_uid.items() if not competitor.admitted}
        active: dict[str, set[str]] = {}  # a limited namespace's runs with clusters, kept through the loop
        for competitor in queue.waiting:
            other, result = uid_of.get(competitor.name), queue.results[competitor.name]
            if other is None or other == uid or not result.ok:
                continue  # not in the index (this run's own record), or told to wait
            assert competitor.spec is not None, "a waiting run's record carries its spec"
            if self.max_active_per_namespace:
                namespace = preflight.namespace_of(competitor.name)
                if namespace not in active:
                    active[namespace] = self._active_in(namespace, indexes)
                if len(active[namespace]) >= self.max_active_per_namespace:
                    continue
                active[namespace].add(other)
            holds = _holding(competitor.name, competitor.created, competitor.spec, result)
            self._admitted[other] = Admitted(now, holds, decided=(competitor.spec, result))

    def _nodes_and_pods(self, indexes: Indexes) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Nodes, and the pods that hold GPUs or EFA, from kopf's indexes. An operator that watches only some
        namespaces cannot see other teams' pods by watching, so it LISTs them: once for every pending run's
        preflight within PODS_SNAPSHOT_SECONDS."""
        nodes = list(indexes.all(indexes.nodes))
        if not self.watch_namespaces:
            return nodes, list(indexes.all(indexes.accelerator_pods))
        now = time.monotonic()
        if self._pods_view is None or now - self._pods_view[0] > PODS_SNAPSHOT_SECONDS:
            assert self.kube is not None, "a namespaced operator lists pods through its client"
            self._pods_view = (now, self.kube.accelerator_pods())
        return nodes, self._pods_view[1]

    def _spec_of(self, run: Mapping[str, Any]) -> api.FSDPTrainingRunSpec | None:
        """Another run's spec, parsed once per generation: admission reads every run's spec in every pass,
        and parsing them all each time was most of a busy minute's garbage. None for a spec that does not
        parse."""
        meta = run["metadata"]
        cached = self._specs.get(meta["uid"])
        if cached is None or cached[0] != meta.get("generation"):
            try:
                spec = api.FSDPTrainingRunSpec.model_validate(run["spec"])
            except ValidationError:
                spec = None
            cached = self._specs[meta["uid"]] = (meta.get("generation"), spec)
        return cached[1]

    def _placement_key(self, spec: api.FSDPTrainingRunSpec) -> str:
        """preflight.placement_key of a spec parsed by _spec_of, once per spec object."""
        found = self._placement_keys.get(id(spec))
        if found is None or found[0] is not spec:
            if len(self._placement_keys) > 4 * len(self._specs) + 64:
                self._placement_keys.clear()  # of specs long replaced
            found = self._placement_keys[id(spec)] = (spec, preflight.placement_key(spec))
        return found[1]

    def _free(
        self, key: str, spec: api.FSDPTrainingRunSpec, nodes: list[Any], pods: list[Any], empty: bool = False
    ) -> tuple[preflight.NodeFree, ...]:
        """preflight.free_worker_nodes for a placement (empty: on nodes holding only their DaemonSets' pods),
        built again only when a node or pod object changed: kopf's indexes hold each object until it changes,
        so identity tells."""
        memo_key = (key, not empty)
        found = self._free_nodes.get(memo_key)
        if empty:
            pods = [pod for pod in pods if preflight.is_daemon(pod)]
        if found is not None and _same_objects(found[0], nodes) and _same_objects(found[1], pods):
            return found[2]
        free = tuple(preflight.free_worker_nodes(spec, nodes, pods))
        if self.efa_through_dra:
            free = tuple(dataclasses.replace(node, efa=preflight.EFA_NOT_COUNTED) for node in free)
        self._free_nodes[memo_key] = (nodes, pods, free)
        return free

    def _competitors(
        self,
        run: builder.RunRef,
        indexes: Indexes,
        nodes: list[dict[str, Any]],
        pods: list[dict[str, Any]],
    ) -> dict[str, preflight.Competitor]:
        """Every run of the operator that wants existing GPU nodes, this one included, by uid: admitted ones
        with workers still to place, and waiting ones (which go first when created earlier, unless they could
        not fit even on empty nodes: those must not hold up everyone behind them)."""
        placed: dict[tuple[str, str], int] = defaultdict(int)
        for pod in pods:
            labels = pod["metadata"].get("labels") or {}
            if labels.get("ray.io/node-type") == "worker" and pod.get("spec", {}).get("nodeName"):
                placed[(pod["metadata"]["namespace"], labels.get(builder.LABEL_RAY_CLUSTER, ""))] += 1
        found: dict[str, preflight.Competitor] = {}
        done_with_slots: set[str] = set()
        # Runs with one placement (instance type, selector, tolerations) see the same nodes: build each list
        # once, and decide once per placement and demand whether a run of it could fit on empty nodes.
        free_now: dict[str, tuple[preflight.NodeFree, ...]] = {}
        free_when_empty: dict[str, tuple[preflight.NodeFree, ...]] = {}
        fits_when_empty: dict[tuple[str, int, int, int, str | None], bool] = {}
        in_index: set[str] = set()
        for other in indexes.all(indexes.runs):
            meta = other["metadata"]
            in_index.add(meta["uid"])
            spec = self._spec_of(other)
            if spec is None:
                continue
            status = other.get("status") or {}
            phase = status.get("phase")
            if meta["uid"] != run.uid and (phase in api.FINISHED_PHASES or spec.suspend):
                done_with_slots.add(meta["uid"])
                continue
            if meta["uid"] != run.uid and spec.preflight.scale_from_zero:
                continue  # adds nodes of its own: no competitor for these (admission may remember it)
            name = f"{meta['namespace']}/{meta['name']}"
            created = meta.get("creationTimestamp", "")
            if phase in api.ACTIVE_PHASES and meta["uid"] != run.uid:
                cluster = builder.ray_cluster_name(meta["name"])
                found[meta["uid"]] = preflight.Competitor(
                    name=name,
                    created=created,
                    instance_type=spec.cluster.instance_type,
                    admitted=True,
                    zone=status.get("zone"),
                    workers_not_placed=max(spec.cluster.workers - placed[(meta["namespace"], cluster)], 0),
                )
                continue
            key = self._placement_key(spec)
            if key not in free_now:
                free_now[key] = self._free(key, spec, nodes, pods)
                free_when_empty[key] = self._free(key, spec, nodes, pods, empty=True)
            cluster_spec = spec.cluster
            demand = (key, cluster_spec.workers, cluster_spec.gpus(), cluster_spec.efa(spec.network),
                      cluster_spec.zone)  # fmt: skip
            if demand not in fits_when_empty:
                fits_when_empty[demand] = preflight.check_nodes(spec, list(free_when_empty[key])).ok
            found[meta["uid"]] = preflight.Competitor(
                name=name,
                created=created,
                instance_type=spec.cluster.instance_type,
                admitted=False,
                zone=None,
                workers_not_placed=spec.cluster.workers,
                fits_when_empty=fits_when_empty[demand],
                spec=spec,
                free=free_now[key],
            )
        # A run deleted with its finalizer stripped by hand never reaches the delete handler that forgets it.
        for uid in self._specs.keys() - in_index - {run.uid}:
            del self._specs[uid]
        now = time.monotonic()
        for uid, admitted in list(self._admitted.items()):
            if now - admitted.since > ADMISSION_MEMORY_SECONDS or uid in done_with_slots:
                del self._admitted[uid]
            elif uid != run.uid and (uid not in found or not found[uid].admitted):
                found[uid] = admitted.holds  # admitted by this process; the index has not caught up yet
        return found


def _holding(
    name: str, created: str, spec: api.FSDPTrainingRunSpec, result: preflight.PreflightResult
) -> preflight.Competitor:
    """What a run admitted by `result` reserves until its workers are placed: all of them, in its zone."""
    return preflight.Competitor(
        name=name,
        created=created,
        instance_type=spec.cluster.instance_type,
        admitted=True,
        zone=result.zone,
        workers_not_placed=spec.cluster.workers,
    )


def _same_objects(before: list[Any], now: list[Any]) -> bool:
    return len(before) == len(now) and all(a is b for a, b in zip(before, now, strict=True))
