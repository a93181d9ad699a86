"""Placement: where a generation runs and what happens when its replica fails. The goodput router ranks replicas
by a request's expected latency (latency.py, the estimate apart from Ray; router.py, Serve's RequestRouter);
failover.py retries a generation whose replica died; autoscaling.py is Serve's custom policy that sizes the
deployment from the replicas' fitted costs. Imports the wire and control below it."""
