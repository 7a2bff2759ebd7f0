"""What tests and benchmarks share, one module per job, each named for it: where things are (paths), bounded
waits (waiting), loopback ports and probes (net), stopping processes (processes), a test clock (clock), the
apiserver (kube), runs and their RayClusters read back (runs), manifests (manifests), GitOps applies
(gitops), the operator as a process (operator_process), the local cluster (local_cluster, control_plane,
real_node), inputs of the operator's decisions (decision_inputs, metrics_index), the trainer driven in-process
and its tiny model (trainer_runs, tiny_model, corpus), the demo's run (demo), each server or tool the suite
runs (mlflow, kueue, argocd, prometheus, chart, image, netproxy, probe_pod, apiserver_audit), and the
reliability table (reliability). No test imports another test."""
