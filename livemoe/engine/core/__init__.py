"""The engine core in its own process: the scheduler, runner and model run there (proc.py), and the
clients (AsyncLLM with engine_core="process", the HTTP server) talk to it over ZeroMQ with msgpack
(messages.py, client.py); with several cores, a router picks one per request (router.py)."""
