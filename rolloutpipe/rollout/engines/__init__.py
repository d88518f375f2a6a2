"""Rollout engines: the ``Engine`` protocol and what speaks it.

    base.py            the Engine protocol the rollout node drives
    embedded.py        the embedded CPU engine: a request scheduler over the transformers model
    sglang_api.py      SGLang's HTTP API shapes (requests, responses, weight updates), client side
    http_client.py     SGLangEngine: one client for real SGLang servers and the embedded server
    http_server.py     the embedded engine behind SGLang's HTTP API (``rollout.engine=embedded_http``)
    server_process.py  starting and stopping server processes (SGLang or embedded)
    factory.py         EngineFactory: ``rollout.engine`` -> engines, and a restart after a failure
    hosts.py           several rollout nodes: each node's engine servers, registered in the store for rank 0
    supervisor.py      engine failures: resubmit a failed engine's requests, restart it

May import: types, model, control/, observe/ (spans), rollout/config.py, rollout/admission.py (the supervisor hands
a failed engine's requests back to it). SGLang itself only inside the processes server_process.py starts.
"""
