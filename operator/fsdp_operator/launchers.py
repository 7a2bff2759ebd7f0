"""What can add nodes to the cluster, read for scale-from-zero preflight: Karpenter's NodePools from the
apiserver, cluster-autoscaler's node groups (EC2 Auto Scaling groups) from AWS, and the DaemonSets whose pods
every added node gets. Each read is bounded by its client's timeouts, and a kind the operator cannot see is
None (preflight.Launchers)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from fsdp_operator import preflight
from fsdp_operator.kube import Kube

log = logging.getLogger(__name__)

# The tag cluster-autoscaler's auto-discovery selects node groups by (EKS managed node groups carry it).
AUTOSCALER_ENABLED_TAG = "k8s.io/cluster-autoscaler/enabled"
# The labels and taints a group's nodes will carry, as cluster-autoscaler reads them from tags at zero nodes.
NODE_TEMPLATE_LABEL = "k8s.io/cluster-autoscaler/node-template/label/"
NODE_TEMPLATE_TAINT = "k8s.io/cluster-autoscaler/node-template/taint/"
# NodePools and node groups change with the platform's configuration: read at most this often, not on every
# pass of every waiting run (AWS throttles DescribeAutoScalingGroups per account).
LAUNCHERS_SECONDS = 30.0


def node_groups(autoscaling: Any, ec2: Any) -> tuple[preflight.NodeGroup, ...]:
    """The Auto Scaling groups tagged for cluster-autoscaler, with their zones and the instance types they
    launch (a mixed-instances policy's overrides, else the launch template's or launch configuration's)."""
    pages = autoscaling.get_paginator("describe_auto_scaling_groups").paginate(
        Filters=[{"Name": "tag-key", "Values": [AUTOSCALER_ENABLED_TAG]}]
    )
    return tuple(
        preflight.NodeGroup(
            name=group["AutoScalingGroupName"],
            zones=tuple(sorted(group.get("AvailabilityZones") or ())),
            instance_types=_instance_types(autoscaling, ec2, group),
            **_node_template(group.get("Tags") or ()),
        )
        for page in pages
        for group in page["AutoScalingGroups"]
    )


def _node_template(tags: Any) -> dict[str, Any]:
    """The node-template labels and taints (value `value:Effect`) a group's tags give its nodes."""
    labels, taints = [], []
    for tag in tags:
        key, value = tag["Key"], tag.get("Value") or ""
        if key.startswith(NODE_TEMPLATE_LABEL):
            labels.append((key.removeprefix(NODE_TEMPLATE_LABEL), value))
        elif key.startswith(NODE_TEMPLATE_TAINT):
            taint_value, _, effect = value.rpartition(":")
            taints.append((key.removeprefix(NODE_TEMPLATE_TAINT), taint_value, effect or "NoSchedule"))
    return {"labels": tuple(sorted(labels)), "taints": tuple(taints)}


def _instance_types(autoscaling: Any, ec2: Any, group: dict[str, Any]) -> tuple[str, ...]:
    mixed = group.get("MixedInstancesPolicy", {}).get("LaunchTemplate", {})
    overrides = tuple(o["InstanceType"] for o in mixed.get("Overrides") or () if o.get("InstanceType"))
    if overrides:
        return overrides
    template = group.get("LaunchTemplate") or mixed.get("LaunchTemplateSpecification")
    if template:
        named = (
            {"LaunchTemplateId": template["LaunchTemplateId"]}
            if template.get("LaunchTemplateId")
            else {"LaunchTemplateName": template["LaunchTemplateName"]}
        )
        versions = ec2.describe_launch_template_versions(
            **named, Versions=[template.get("Version") or "$Default"]
        )["LaunchTemplateVersions"]
        return tuple(
            v["LaunchTemplateData"]["InstanceType"]
            for v in versions
            if v.get("LaunchTemplateData", {}).get("InstanceType")
        )
    if group.get("LaunchConfigurationName"):
        configurations = autoscaling.describe_launch_configurations(
            LaunchConfigurationNames=[group["LaunchConfigurationName"]]
        )["LaunchConfigurations"]
        return tuple(c["InstanceType"] for c in configurations)
    return ()


class LauncherReader:
    """The cluster's launchers as of at most LAUNCHERS_SECONDS ago."""

    def __init__(self, kube: Kube | None, ec2: Callable[[], Any], autoscaling: Callable[[], Any]) -> None:
        self.kube = kube
        self.ec2 = ec2  # the clients, built on first use
        self.autoscaling = autoscaling
        self._lock = threading.Lock()
        self._seen: tuple[float, preflight.Launchers] | None = None

    def read(self) -> preflight.Launchers:
        with self._lock:
            now = time.monotonic()
            if self._seen is None or now - self._seen[0] > LAUNCHERS_SECONDS:
                self._seen = (
                    now,
                    preflight.Launchers(self._nodepools(), self._node_groups(), self._daemonsets()),
                )
            return self._seen[1]

    def _nodepools(self) -> tuple[preflight.NodePool, ...] | None:
        found = self.kube.nodepools() if self.kube is not None else None
        return None if found is None else tuple(preflight.NodePool.of(body) for body in found)

    def _daemonsets(self) -> tuple[preflight.DaemonSetDemand, ...]:
        found = self.kube.daemonsets() if self.kube is not None else None
        return tuple(preflight.DaemonSetDemand.of(body) for body in found or ())

    def _node_groups(self) -> tuple[preflight.NodeGroup, ...] | None:
        autoscaling = self.autoscaling()
        if autoscaling is None:  # an operator built without AWS clients
            return None
        try:
            return node_groups(autoscaling, self.ec2())
        except (BotoCoreError, ClientError) as error:  # no permission, no endpoint: not visible
            log.info("node groups not visible to preflight: %s", error)
            return None
