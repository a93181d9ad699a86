"""SmartSpec on Ray Serve: `serve run config.yaml` builds the application in `deployments.app`."""
