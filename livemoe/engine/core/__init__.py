"""The engine core behind AsyncLLM: one client interface (client.py) with an in-thread implementation (inproc.py)
and one over engine-core processes (mp_client.py, replica.py; the process itself: proc.py), both speaking one
command protocol (service.py) in typed messages (messages.py); with several cores, a router picks one per request
(router.py)."""
