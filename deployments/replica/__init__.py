"""The replica: `LLMServer` (server.py), one engine per Serve replica that takes `GenerateCall`s and streams the
wire's events back, with the draft model in its own Ray actor (draft_worker.py) and tensor-parallel rank actors
(tp_workers.py) where configured. Imports the wire, control and placement below it."""
