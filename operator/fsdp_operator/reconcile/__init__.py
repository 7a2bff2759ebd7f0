"""The run's state machine as a pure function: (spec, status, what was observed) -> new status and actions.

Kopf handlers gather observations (all I/O, each bounded by a timeout), call `reconcile`, write the new
status conditionally on the resourceVersion they read, and only then carry out the actions. So the status
always records an intent (the attempt number, its submission id, the cluster and zone) before its side
effect happens: a replayed event, a stale pass or a second operator process loses the status write and never
acts, and an action that fails becomes an observation of the next pass.

    Pending --preflight ok--> Provisioning --KubeRay ready--> ClusterReady --submit--> Running --> Succeeded
       ^  |                        |   (provisioning timeout: back to Pending or Failed)        |
       |  +--preflight Fail policy--> Failed <--permanent failure / restarts exhausted---------+
       |                            Restarting <--retryable failure (job failed, lost, hung, cluster lost)
    Suspended                         +--backoff over, old job ended, cluster ready--> Running (attempt+1)

With a Kueue queue (spec.cluster.queueName) Kueue admits instead of the preflight: Pending creates the
RayCluster suspended and the run is Queued; Kueue unsuspending it is the admission (-> Provisioning), and
Kueue suspending it again is a preemption: the job is stopped and the run is Queued again, without spending
a restart; the next admission resumes from the latest checkpoint.

A pass absorbs the facts first (progress, checkpoints, storage, transport, a changed image request, the pods'
health), then runs the guards (suspended, deadline, cluster being deleted, pods that never started,
provisioning timeout: each decides the pass or changes nothing), then one step function for the phase. Every
status field is set here, from the observation: the glue only writes what this returns.

The modules, by the run's phases: observation (what a pass is given) and decision (what it returns); state
(the pass under construction and the primitives every phase uses); machine (the pass's order, the guards and
the step of each phase); trainer_records and images (facts absorbed in every phase); pending and queueing
(until a RayCluster is admitted); provisioning (until it is ready, and pods that cannot start or be placed);
running (submission, the job's end, restarts) and liveness (setup and hang timeouts, hang forensics).
"""

from fsdp_operator.reconcile.decision import Decision, DriverLog, Event
from fsdp_operator.reconcile.machine import INVALID_SPEC, reconcile, refused_spec
from fsdp_operator.reconcile.observation import (
    ClusterObservation,
    Observation,
    OomKill,
    PodProblem,
    PodsProgress,
    creates_cluster_next,
    job_to_observe,
    needs_preflight,
    needs_workload,
    observe_cluster,
    ready_for_a_job,
    ready_for_elastic,
)
from fsdp_operator.reconcile.trainer_records import MAX_EVIDENCE_LINES, MAX_TRAINER_TEXT

__all__ = [
    "INVALID_SPEC",
    "MAX_EVIDENCE_LINES",
    "MAX_TRAINER_TEXT",
    "ClusterObservation",
    "Decision",
    "DriverLog",
    "Event",
    "Observation",
    "OomKill",
    "PodProblem",
    "PodsProgress",
    "creates_cluster_next",
    "job_to_observe",
    "needs_preflight",
    "needs_workload",
    "observe_cluster",
    "ready_for_a_job",
    "ready_for_elastic",
    "reconcile",
    "refused_spec",
]
