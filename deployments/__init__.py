"""SmartSpec on Ray Serve: `serve run config.yaml` builds the application in `deployments.app`.

Its rooms, bottom to top (each imports only those below it; tests/test_layering.py holds the order):
wire.py (the typed call and events between front and replicas), control/ (config, controller, metrics),
placement/ (router, failover, autoscaling), replica/ (LLMServer and its actors), http/ (the OpenAI front), and
app.py, which builds the application."""
