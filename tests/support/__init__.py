"""What tests and benchmarks share, one module per job: where things are (paths), waiting (waiting), loopback
ports and HTTP probes (net), stopping processes (processes), the operator as a process (operator_process), the
apiserver through kubectl and a client (kube), runs read back (runs), manifests (manifests), GitOps applies
(gitops), the local control plane's processes (control_plane), the local cluster's endpoints (local_cluster),
MLflow (mlflow), and the suite's other servers and tools in modules named for them."""
