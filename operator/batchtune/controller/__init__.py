"""The operator: kopf handlers (thin) sequencing ports and the pure core.

- `reconcile`: one tick of one BatchTuning, dispatching to the phase modules `plan`, `trials`,
  `decide`, `apply`; `tick` holds what a tick knows; `status` converts status in and out.
- `ports`: what the loop asks of the world; `kube` (Kubernetes, over kopf indexes) and `prometheus`
  (the one place that reads Prometheus) implement it; the unit tests implement it in memory.
- `handlers`: kopf wiring; `reports`: the report ConfigMap, written off the reconcile path;
  `telemetry`: the operator's own metrics.
"""
