"""The operator: kopf handlers (thin) over pure decision modules and small I/O modules.

- `failures`, `gitops`, `loadsearch`, `flow`, `conditions`: pure decisions, unit-tested without a cluster.
- `kube`, `prom`: the only modules that talk to the API server and to Prometheus.
- `handlers`: kopf wiring; `report`: the report ConfigMap and the three-curve image.
"""
