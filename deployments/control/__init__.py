"""Control: the application's typed configuration (config.py, the `args:` of config.yaml), the goodput controller
that merges the replicas' policy state (controller.py), and the Prometheus metrics (metrics.py). Imports only the
wire and the engine's packages."""
