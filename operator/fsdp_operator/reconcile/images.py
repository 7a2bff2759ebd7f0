"""The run's image across its phases: the one requested, the digest the pods pulled (pinned for every later
attempt), and pods that disagree on it."""

from __future__ import annotations

from fsdp_operator import api, conditions
from fsdp_operator.api import Phase
from fsdp_operator.reconcile.state import STILL_ENDING_REQUEUE_SECONDS, PassState


def comparable_image_ids(image_ids: tuple[str, ...]) -> tuple[str, ...]:
    """The registry digests (repo@sha256:...) among the pods' image IDs, when there are any. A node reports
    one image either way: by its registry digest, or by its bare config digest (sha256:..., for an image with
    no registry digest, or before the runtime has recorded it); the two forms never compare equal, so mixing
    them would see one image as two and recreate a cluster for ever."""
    digests = tuple(image_id for image_id in image_ids if "@" in image_id)
    return digests or image_ids


def absorb_image_request(state: PassState) -> None:
    """A new spec.image (allowed only while no cluster exists) drops the digest pinned for the old one."""
    image, requested = state.new.image, state.obs.requested_image
    waiting = state.new.phase not in api.ACTIVE_PHASES
    if requested and image.requested and image.requested != requested and waiting:
        if image.digest:
            state.event(
                False,
                "ImageRequestChanged",
                f"image {requested} requested; the digest pinned for {image.requested} "
                f"({image.digest}) is dropped and the next pull is pinned",
            )
        state.new.image = api.ImageStatus(requested=requested)


def absorb_pods_image(state: PassState) -> None:
    """The digest the pods run, once the cluster is past provisioning (ready, or given up): while it
    provisions, pods start one by one, and pinning the first one's would cost a status write alone."""
    if state.obs.pod_image_ids and state.new.phase != Phase.PROVISIONING:
        absorb_image(state, set(comparable_image_ids(state.obs.pod_image_ids)))


def absorb_image(state: PassState, image_ids: set[str]) -> None:
    image = state.new.image
    if len(image_ids) > 1:
        message = "pods ran different images: " + ", ".join(sorted(image_ids))
        if image.consistent is not False:
            state.event(True, "ImageMismatch", message)
        image.consistent = False
        state.condition(conditions.IMAGE_CONSISTENT, False, "PodsDisagree", message)
        return
    (image_id,) = image_ids
    if image.digest is None:
        state.event(False, "ImagePinned", f"pods run {image_id}; every later attempt uses this digest")
    elif image.digest != image_id and image.consistent is not False:
        state.event(True, "ImageChanged", f"pods run {image_id}, not the pinned {image.digest}")
    image.digest = image.digest or image_id
    image.consistent = image.digest == image_id
    state.condition(
        conditions.IMAGE_CONSISTENT,
        image.consistent,
        "PodsAgree" if image.consistent else "DigestChanged",
        f"head and workers run {image_id}",
    )


def pods_disagree(state: PassState) -> bool:
    """Pods of a new cluster that pulled different images for one tag (nodes holding different copies of a
    republished tag: different NCCL builds in one job): before any job runs, the cluster is recreated on
    the digest most of them run, pinned for every later attempt."""
    ids = comparable_image_ids(state.obs.pod_image_ids)
    submitted = state.new.job_submission_id is not None and state.new.phase == Phase.CLUSTER_READY
    if len(set(ids)) < 2 or submitted:
        return False
    chosen = max(sorted(set(ids)), key=ids.count)
    message = f"pods pulled different images ({', '.join(sorted(set(ids)))}): recreating on {chosen}"
    state.event(True, "ImageMismatch", message)
    state.new.image.digest, state.new.image.consistent = chosen, None
    state.condition(conditions.IMAGE_CONSISTENT, False, "Recreating", message)
    state.condition(conditions.CLUSTER_READY, False, "ImageMismatch", message)
    state.transition(Phase.PROVISIONING, "ImageMismatch", message, announce=False)
    state.decision.delete_cluster = True
    state.requeue(STILL_ENDING_REQUEUE_SECONDS)
    return True
