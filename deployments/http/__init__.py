"""The HTTP front: the OpenAI-compatible API (FastAPI through @serve.ingress). It validates requests into typed
fields (protocol.py), turns them into one `GenerateCall` per choice, sends them to the replicas through a
streaming handle with failover, and folds the events that come back into the endpoint's answer (fold.py,
answers.py), streamed or whole; tool calls are read out of the text (tools.py). Imports the wire, control and
placement below it; nothing imports it but the application builder."""
