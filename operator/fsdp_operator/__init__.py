"""Kopf operator for FSDPTrainingRun resources on KubeRay."""
